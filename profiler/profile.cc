// Placeholder while the profiler issue is built; replaced by its implementation.
#include "profiler/commands.h"
#include "profiler/profile.h"
