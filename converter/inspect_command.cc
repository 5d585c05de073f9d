// `nflash inspect`: a readable (or JSON) summary of a GGUF file, a safetensors file or a llama2.c checkpoint.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "converter/commands.h"
#include "converter/llama2c_reader.h"
#include "converter/safetensors.h"
#include "runtime/core/file.h"
#include "runtime/core/gguf.h"

namespace nflash::converter {
namespace {

using Json = nlohmann::ordered_json;

// Arrays are shown as their type, length and this many first items (vocabularies have 32k-256k entries).
constexpr size_t kArrayPreview = 5;
// Longer strings (chat templates, licences) are cut in the text view.
constexpr size_t kStringPreview = 96;

struct InspectFlags {
  std::string path;
  bool json = false;
  bool tensors = false;
  std::string plot;
  InspectDelegates delegates;
};

std::string Quote(const std::string& s, bool cut) {
  std::string body = s;
  std::string suffix;
  if (cut && body.size() > kStringPreview) {
    body.resize(kStringPreview);
    suffix = "... (" + std::to_string(s.size()) + " bytes)";
  }
  std::string out = "\"";
  for (char c : body) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '"') {
      out += "\\\"";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"" + suffix;
}

std::string ValueText(const GgufValue& v) {
  return std::visit(
      [&](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return Quote(x, true);
        } else if constexpr (std::is_same_v<T, GgufArray>) {
          std::string s = "[" + std::string(GgufTypeName(x.element_type)) + " x" + std::to_string(x.items.size());
          for (size_t i = 0; i < x.items.size() && i < kArrayPreview; ++i) {
            s += (i ? ", " : ": ") + ValueText(x.items[i]);
          }
          return s + (x.items.size() > kArrayPreview ? ", ...]" : "]");
        } else if constexpr (std::is_same_v<T, bool>) {
          return x ? "true" : "false";
        } else if constexpr (std::is_floating_point_v<T>) {
          std::ostringstream os;
          os << x;
          return os.str();
        } else {
          return std::to_string(x);
        }
      },
      v.v);
}

Json ValueJson(const GgufValue& v) {
  return std::visit(
      [&](const auto& x) -> Json {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, GgufArray>) {
          Json first = Json::array();
          for (size_t i = 0; i < x.items.size() && i < kArrayPreview; ++i) first.push_back(ValueJson(x.items[i]));
          return Json{{"type", "array"},
                      {"element_type", std::string(GgufTypeName(x.element_type))},
                      {"length", x.items.size()},
                      {"first", first}};
        } else {
          return Json(x);
        }
      },
      v.v);
}


void PrintJson(const Json& j) {
  // Token strings may hold invalid UTF-8 (byte-level vocabularies): replace rather than throw.
  std::printf("%s\n", j.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
}

Status InspectGguf(const InspectFlags& flags) {
  NF_ASSIGN_OR_RETURN(GgufFile f, GgufFile::OpenPath(flags.path));
  std::string arch = "(none)";
  if (f.Find("general.architecture") != nullptr) {
    NF_ASSIGN_OR_RETURN(arch, f.GetString("general.architecture"));
  }
  std::string name;
  if (f.Find("general.name") != nullptr) {
    NF_ASSIGN_OR_RETURN(name, f.GetString("general.name"));
  }
  const bool synthetic = name.find("synthetic") != std::string::npos;

  std::map<std::string, std::pair<size_t, uint64_t>> by_type;  // type name -> (count, bytes)
  uint64_t tensor_bytes = 0;
  for (const GgufTensorInfo& t : f.tensors()) {
    auto& e = by_type[std::string(GgmlTypeName(t.type))];
    ++e.first;
    e.second += t.n_bytes;
    tensor_bytes += t.n_bytes;
  }
  // The hyper-parameters llama.cpp needs, in one place (all are also listed with the metadata).
  static const char* kHyper[] = {"context_length",         "embedding_length",
                                 "block_count",            "feed_forward_length",
                                 "attention.head_count",   "attention.head_count_kv",
                                 "rope.dimension_count",   "rope.freq_base",
                                 "attention.layer_norm_rms_epsilon", "vocab_size",
                                 "expert_count",           "expert_used_count",
                                 "attention.sliding_window"};

  if (flags.json) {
    Json j;
    j["path"] = flags.path;
    j["format"] = "gguf";
    j["version"] = f.version();
    j["file_bytes"] = f.file().Size();
    j["alignment"] = f.alignment();
    j["data_offset"] = f.data_offset();
    j["architecture"] = arch;
    j["name"] = name;
    j["synthetic"] = synthetic;
    Json hyper = Json::object();
    for (const char* k : kHyper) {
      if (const GgufValue* v = f.Find(arch + "." + k)) hyper[k] = ValueJson(*v);
    }
    j["hyper_parameters"] = hyper;
    Json meta = Json::object();
    for (const auto& [k, v] : f.metadata()) meta[k] = ValueJson(v);
    j["metadata"] = meta;
    j["tensor_count"] = f.tensors().size();
    j["tensor_bytes"] = tensor_bytes;
    Json types = Json::object();
    for (const auto& [t, e] : by_type) types[t] = Json{{"count", e.first}, {"bytes", e.second}};
    j["bytes_by_type"] = types;
    if (flags.tensors) {
      Json list = Json::array();
      for (const GgufTensorInfo& t : f.tensors()) {
        list.push_back(Json{{"name", t.name},
                            {"type", std::string(GgmlTypeName(t.type))},
                            {"dims", t.dims},
                            {"offset", t.offset},
                            {"bytes", t.n_bytes}});
      }
      j["tensors"] = list;
    }
    PrintJson(j);
    return Status::Ok();
  }

  std::printf("%s: GGUF v%u, %llu bytes, alignment %u, data at offset %llu\n", flags.path.c_str(), f.version(),
              static_cast<unsigned long long>(f.file().Size()), f.alignment(),
              static_cast<unsigned long long>(f.data_offset()));
  std::printf("architecture: %s\n", arch.c_str());
  std::printf("name: %s%s\n", name.empty() ? "(none)" : name.c_str(),
              synthetic ? "  ** SYNTHETIC weights: not a trained model **" : "");
  std::printf("hyper-parameters:\n");
  for (const char* k : kHyper) {
    if (const GgufValue* v = f.Find(arch + "." + k)) std::printf("  %-34s %s\n", k, ValueText(*v).c_str());
  }
  std::printf("metadata: %zu keys\n", f.metadata().size());
  for (const auto& [k, v] : f.metadata()) std::printf("  %-40s %s\n", k.c_str(), ValueText(v).c_str());
  std::printf("tensors: %zu, %llu bytes\n", f.tensors().size(), static_cast<unsigned long long>(tensor_bytes));
  for (const auto& [t, e] : by_type) {
    std::printf("  %-6s %5zu tensors %14llu bytes\n", t.c_str(), e.first, static_cast<unsigned long long>(e.second));
  }
  if (flags.tensors) {
    std::printf("  %-36s %-6s %-24s %14s\n", "name", "type", "shape", "bytes");
    for (const GgufTensorInfo& t : f.tensors()) {
      std::printf("  %-36s %-6s %-24s %14llu\n", t.name.c_str(), std::string(GgmlTypeName(t.type)).c_str(),
                  ShapeToString(t.dims).c_str(), static_cast<unsigned long long>(t.n_bytes));
    }
  }
  return Status::Ok();
}

Status InspectSafetensors(const InspectFlags& flags) {
  NF_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::OpenPath(flags.path));
  std::map<std::string, std::pair<size_t, uint64_t>> by_type;
  for (const SafetensorsTensor& t : f.tensors()) {
    auto& e = by_type[SafetensorsDtypeName(t.dtype)];
    ++e.first;
    e.second += t.n_bytes;
  }
  if (flags.json) {
    Json j;
    j["path"] = flags.path;
    j["format"] = "safetensors";
    j["file_bytes"] = f.file_size();
    j["header_bytes"] = f.header_bytes();
    Json meta = Json::object();
    for (const auto& [k, v] : f.metadata()) meta[k] = v;
    j["metadata"] = meta;
    j["tensor_count"] = f.tensors().size();
    j["tensor_bytes"] = f.total_tensor_bytes();
    Json types = Json::object();
    for (const auto& [t, e] : by_type) types[t] = Json{{"count", e.first}, {"bytes", e.second}};
    j["bytes_by_type"] = types;
    if (flags.tensors) {
      Json list = Json::array();
      for (const SafetensorsTensor& t : f.tensors()) {
        list.push_back(Json{{"name", t.name},
                            {"dtype", SafetensorsDtypeName(t.dtype)},
                            {"shape", t.shape},
                            {"offset", t.offset},
                            {"bytes", t.n_bytes}});
      }
      j["tensors"] = list;
    }
    PrintJson(j);
    return Status::Ok();
  }
  std::printf("%s: safetensors, %llu bytes, JSON header %llu bytes\n", flags.path.c_str(),
              static_cast<unsigned long long>(f.file_size()), static_cast<unsigned long long>(f.header_bytes()));
  std::printf("metadata: %zu keys\n", f.metadata().size());
  for (const auto& [k, v] : f.metadata()) std::printf("  %-40s %s\n", k.c_str(), Quote(v, true).c_str());
  std::printf("tensors: %zu, %llu bytes\n", f.tensors().size(),
              static_cast<unsigned long long>(f.total_tensor_bytes()));
  for (const auto& [t, e] : by_type) {
    std::printf("  %-6s %5zu tensors %14llu bytes\n", t.c_str(), e.first, static_cast<unsigned long long>(e.second));
  }
  if (flags.tensors) {
    std::printf("  %-48s %-5s %-24s %14s\n", "name", "dtype", "shape (row-major)", "bytes");
    for (const SafetensorsTensor& t : f.tensors()) {
      std::printf("  %-48s %-5s %-24s %14llu\n", t.name.c_str(), SafetensorsDtypeName(t.dtype),
                  ShapeToString(t.shape).c_str(), static_cast<unsigned long long>(t.n_bytes));
    }
  }
  return Status::Ok();
}

Status InspectLlama2c(const InspectFlags& flags) {
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenPreadFile(flags.path));
  Result<Llama2cHeader> header = ReadLlama2cHeader(*file);
  if (!header.ok()) {
    return header.status().WithContext("not a GGUF or safetensors file, and not a valid llama2.c checkpoint");
  }
  const Llama2cHeader& h = *header;
  const bool size_ok = h.file_bytes == h.expected_file_bytes;
  // A header that fails the size check may claim millions of layers: its layout is listed only when short.
  constexpr int64_t kMaxListedLayers = 4096;
  const bool list_layout = size_ok || h.n_layers <= kMaxListedLayers;
  const std::vector<Llama2cTensor> layout = list_layout ? Llama2cLayout(h) : std::vector<Llama2cTensor>{};
  if (flags.json) {
    Json j;
    j["path"] = flags.path;
    j["format"] = "llama2c";
    j["version"] = h.version;
    j["header"] = Json{{"dim", h.dim},           {"hidden_dim", h.hidden_dim}, {"n_layers", h.n_layers},
                       {"n_heads", h.n_heads},   {"n_kv_heads", h.n_kv_heads}, {"vocab_size", h.vocab_size},
                       {"seq_len", h.seq_len},   {"shared_classifier", h.shared_classifier}};
    j["header_bytes"] = h.header_bytes;
    j["expected_file_bytes"] = h.expected_file_bytes;
    j["file_bytes"] = h.file_bytes;
    j["size_ok"] = size_ok;
    if (flags.tensors && !list_layout) {
      j["tensors_omitted"] = std::to_string(h.n_layers) + " layers and a size mismatch";
    } else if (flags.tensors) {
      Json list = Json::array();
      for (const Llama2cTensor& t : layout) {
        list.push_back(Json{{"source_name", t.source_name},
                            {"gguf_name", t.name},
                            {"dims", t.dims},
                            {"offset", t.offset},
                            {"bytes", t.n_elements * 4}});
      }
      j["tensors"] = list;
    }
    PrintJson(j);
  } else {
    std::printf("%s: llama2.c checkpoint v%d (%s), %llu bytes\n", flags.path.c_str(), h.version,
                h.version == 0 ? "legacy, no magic" : "'ak42' header", static_cast<unsigned long long>(h.file_bytes));
    std::printf("  dim %lld, hidden_dim %lld, n_layers %lld, n_heads %lld, n_kv_heads %lld, vocab_size %lld, "
                "seq_len %lld\n",
                static_cast<long long>(h.dim), static_cast<long long>(h.hidden_dim),
                static_cast<long long>(h.n_layers), static_cast<long long>(h.n_heads),
                static_cast<long long>(h.n_kv_heads), static_cast<long long>(h.vocab_size),
                static_cast<long long>(h.seq_len));
    std::printf("  classifier: %s\n", h.shared_classifier ? "shared with the token embedding" : "separate (wcls)");
    std::printf("  size check: %s (header implies %llu bytes, file has %llu)\n", size_ok ? "ok" : "MISMATCH",
                static_cast<unsigned long long>(h.expected_file_bytes),
                static_cast<unsigned long long>(h.file_bytes));
    if (list_layout) {
      std::printf("  arrays: %zu (fp32)\n", layout.size());
    } else {
      std::printf("  arrays: not listed (%lld layers and a size mismatch)\n", static_cast<long long>(h.n_layers));
    }
    if (flags.tensors && list_layout) {
      std::printf("  %-24s %-28s %-16s %12s %12s\n", "llama2.c", "gguf name", "gguf dims", "offset", "bytes");
      for (const Llama2cTensor& t : layout) {
        std::printf("  %-24s %-28s %-16s %12llu %12llu\n", t.source_name.c_str(),
                    t.name.empty() ? "(skipped)" : t.name.c_str(), ShapeToString(t.dims).c_str(),
                    static_cast<unsigned long long>(t.offset), static_cast<unsigned long long>(t.n_elements * 4));
      }
    }
  }
  if (!size_ok) {
    return Status::Corruption(flags.path + ": llama2.c header implies " + std::to_string(h.expected_file_bytes) +
                              " bytes, found " + std::to_string(h.file_bytes));
  }
  return Status::Ok();
}

// What inspect prints for each kind of input: a model as text or JSON, with its tensors or not; a profile as text,
// with --plot also its curves; a deployment as text. A view flag the input's kind has no use for is refused by name
// (it printed the same as without it).
enum class InputKind { kModel, kProfile, kDeployment };

Status CheckViewFlags(const InspectFlags& flags, InputKind kind, const std::string& what) {
  const bool model = kind == InputKind::kModel;
  std::string flag;
  if (!model && flags.json) {
    flag = "--json";
  } else if (!model && flags.tensors) {
    flag = "--tensors";
  } else if (kind != InputKind::kProfile && !flags.plot.empty()) {
    flag = "--plot";
  }
  if (flag.empty()) return Status::Ok();
  const std::string supports = model ? "as text or --json, with or without --tensors (--plot is for profiles)"
                               : kind == InputKind::kProfile ? "as text only, with --plot also its curves"
                                                             : "as text only";
  return Status::InvalidArgument(flag + " does not apply to " + flags.path + ", " + what + ": inspect prints it " +
                                 supports);
}

Status RunInspect(const InspectFlags& flags) {
  std::error_code ec;
  if (std::filesystem::is_directory(flags.path, ec)) {
    if (!flags.delegates.deployment) return Status::Unsupported(flags.path + ": a directory, and no deployment reader");
    NF_RETURN_IF_ERROR(CheckViewFlags(flags, InputKind::kDeployment, "a deployment directory"));
    return flags.delegates.deployment(flags.path);
  }
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenPreadFile(flags.path));
  uint8_t head[9] = {};
  const size_t n = static_cast<size_t>(std::min<uint64_t>(file->Size(), sizeof head));
  NF_RETURN_IF_ERROR(file->ReadAt(0, n, head));
  uint32_t magic = 0;
  std::memcpy(&magic, head, 4);
  if (n >= 4 && magic == kGgufMagic) {
    if (flags.delegates.profile) {
      NF_ASSIGN_OR_RETURN(GgufFile f, GgufFile::OpenPath(flags.path));
      if (f.Find("nflash.profile.schema_version") != nullptr) {
        NF_RETURN_IF_ERROR(CheckViewFlags(flags, InputKind::kProfile, "a profile"));
        return flags.delegates.profile(flags.path, flags.plot);
      }
    }
    NF_RETURN_IF_ERROR(CheckViewFlags(flags, InputKind::kModel, "a GGUF model"));
    return InspectGguf(flags);
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, head, 8);
  // safetensors: a u64 JSON length that fits the file, then the JSON object's opening brace.
  if (n == sizeof head && head[8] == '{' && header_len <= file->Size() - 8) {
    NF_RETURN_IF_ERROR(CheckViewFlags(flags, InputKind::kModel, "a safetensors file"));
    return InspectSafetensors(flags);
  }
  NF_RETURN_IF_ERROR(CheckViewFlags(flags, InputKind::kModel, "a llama2.c checkpoint"));
  return InspectLlama2c(flags);
}

}  // namespace

void RegisterInspectCommand(CLI::App& app, cli::CommandAction* action, const InspectDelegates& delegates) {
  auto flags = std::make_shared<InspectFlags>();
  flags->delegates = delegates;
  CLI::App* cmd = app.add_subcommand(
      "inspect", "Summarize a GGUF model, a safetensors file, a llama2.c checkpoint, a profile or a deployment directory");
  cmd->add_option("file", flags->path, "File or deployment directory to inspect (format detected from its contents)")
      ->required();
  cmd->add_option("--plot", flags->plot, "Profiles only: also draw popularity and hit-rate curves to this .png/.svg");
  cmd->add_flag("--json", flags->json, "Models only (GGUF, safetensors, llama2.c): print JSON instead of text");
  cmd->add_flag("--tensors", flags->tensors, "Models only: list every tensor (name, type, shape, bytes)");
  cmd->callback([flags, action] { *action = [flags] { return RunInspect(*flags); }; });
}

}  // namespace nflash::converter
