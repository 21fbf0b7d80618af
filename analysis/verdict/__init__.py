"""The paper's claims against our numbers: the rule (rule), the run-to-run noise (noise), the frames a
claim is measured in (context), the statistics (statistics), and one verdict per claim (evaluate)."""
