"""GPU benchmarks (run_all.sh); each runs on the GPU image alone and writes JSON under $OUT."""
