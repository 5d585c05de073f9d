# Fig. 6 analogue: decode tok/s per mode at one memory budget, from fig6.dat (scripts/eval/tables.py).
# Run in the results directory with -e "machine='...'".
set terminal svg size 720,420 dynamic font "sans,11"
set output "fig6_decode.svg"
set title "Decode speed at the same memory budget (SYNTHETIC weights, layers cut)\n".machine noenhanced
set ylabel "tokens/s (higher is better)"
set style data histograms
set style histogram errorbars gap 2 lw 1
set style fill solid 0.6 border -1
set boxwidth 0.8
set yrange [0:*]
set grid ytics
unset key
plot "fig6.dat" using 2:3:xtic(1) lc rgb "#3070b0"
