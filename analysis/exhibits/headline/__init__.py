"""The headline Lp sweep (paper Sec. 4): throughput, its steps, the limitation regime, prefill alone."""
