"""Real SGLang: our engine's fidelity to it, and the paper's systems inside it (the plugin)."""
