# Fig. 8 analogue: per layer of a batched prefill, compute time against the time to read the layer's FFN region
# sequentially, and the part of that read the compute did not hide, from fig8.dat (scripts/eval/tables.py).
if (system("test -f fig8.dat && echo 1") ne "1") exit
set terminal svg size 820,420 dynamic font "sans,11"
set output "fig8_prefill.svg"
set title "Prefill per layer: compute vs sequential flash reads (SYNTHETIC weights)\n".machine noenhanced
set xlabel "layer"
set ylabel "ms"
set style data histograms
set style histogram clustered gap 2
set style fill solid 0.6 border -1
set grid ytics
set key top left autotitle columnhead
plot "fig8.dat" using 2:xtic(1), "" using 3, "" using 4
