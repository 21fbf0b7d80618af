"""Frames measured from the raw results, shared by exhibits, the verdicts and the REPORT: kernel rows,
profiler traces, step traces, the dispatcher, SGLang's plugin, Amdahl, the beyond-the-paper families.
Frames only: no table is written, no figure drawn and no prose composed here."""
