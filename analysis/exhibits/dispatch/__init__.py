"""The dispatcher: routing (B.4), its decision table's regret, its cost per step (B.5), several classes."""
