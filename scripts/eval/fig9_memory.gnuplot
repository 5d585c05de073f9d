# Fig. 9 analogue: decode tok/s as the memory budget grows, from fig9.dat and inmem.dat (scripts/eval/tables.py).
set terminal svg size 720,420 dynamic font "sans,11"
set output "fig9_memory.svg"
set title "Decode speed vs memory budget (SYNTHETIC weights, layers cut)\n".machine noenhanced
set xlabel "memory budget (MiB)"
set ylabel "tokens/s (log scale)"
set logscale y
set grid
set key top left
inmem = system("cat inmem.dat") + 0
plot "fig9.dat" using 1:($2 > 0 ? $2 : 1/0) with linespoints lw 2 pt 7 title "full (sparse, flash)", \
     "fig9.dat" using 1:($3 > 0 ? $3 : 1/0) with linespoints lw 2 pt 5 title "dense-mmap (cgroup)", \
     "fig9.dat" using 1:($4 > 0 ? $4 : 1/0) with linespoints dt 2 pt 6 title "plan prediction", \
     inmem with lines dt 3 lw 2 title "in-memory dense"
