"""live: the real harness (HTTP gate in front of GPT-2, open-loop replay).

Not built yet; it will reuse qsim's ``decide``, ``SpeedTracker``, traces and
record schema rather than copies of them.
"""
