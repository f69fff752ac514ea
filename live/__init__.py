"""live: the real harness — an asyncio gate and FastAPI service in front of GPT-2 or a
synthetic engine, an open-loop replayer of qsim traces, calibration, and live passes.

It reuses qsim's ``decide``, ``cannot_finish``, ``SpeedTracker``, traces and record
schema rather than copies of them. Torch is imported only by ``live.gpt2``.
"""
