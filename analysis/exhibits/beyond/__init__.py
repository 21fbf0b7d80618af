"""Beyond the paper: where the static design loses to SGLang default, with steps and plan cost."""
