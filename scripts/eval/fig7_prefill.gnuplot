# Fig. 7 analogue: prefill tok/s per mode and prompt length, from fig7.dat (scripts/eval/tables.py).
set terminal svg size 720,420 dynamic font "sans,11"
set output "fig7_prefill.svg"
set title "Prefill speed at the same memory budget (SYNTHETIC weights, layers cut)\n".machine noenhanced
set ylabel "tokens/s (log scale)"
set logscale y
set style data histograms
set style histogram clustered gap 2
set style fill solid 0.6 border -1
set grid ytics
set key top right autotitle columnhead
n = system("head -1 fig7.dat | wc -w") + 0
plot for [i=2:n] "fig7.dat" using i:xtic(1)
