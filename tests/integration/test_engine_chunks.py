"""The engine hands a job's text over in chunks of `stream_tokens` tokens, first token at once.

Runs the real vLLM engine on the local model in a process of its own (vLLM and torch stay out
of the test process), with every step's deltas handed over at once (`stream_interval_ms=0`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from workers.devices import DeviceSpec, pin_devices
pin_devices(DeviceSpec("cpu"))
from core.settings import Settings
from workers.engine import VllmEngine
from workers.generation import GenerationRequest

model, stream_tokens = sys.argv[1], int(sys.argv[2])
settings = Settings(model=model, stream_interval_ms=0, stream_tokens=stream_tokens)
deltas = []
engine = VllmEngine(settings, device="cpu", num_gpus=0, on_deltas=deltas.extend)
engine.start()
try:
    request = GenerationRequest(
        request_id="probe-1", prompt="Count for me.", job_id="job_probe", attempt=1,
        sampling={"max_tokens": 21, "ignore_eos": True, "temperature": 1.0},
        priority=0, timeout_s=120,
    )
    result = engine.submit(request).result(timeout=120)
finally:
    engine.shutdown()
print("PROBE " + json.dumps({
    "tokens": [d.tokens for d in deltas if d.job_id == "job_probe"],
    "text": "".join(d.text for d in deltas if d.job_id == "job_probe"),
    "result_text": result.text,
    "completion_tokens": result.completion_tokens,
}))
"""


def _probe(model_dir: Path, stream_tokens: int) -> dict[str, object]:
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(model_dir), str(stream_tokens)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("PROBE ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    found: dict[str, object] = json.loads(lines[-1].removeprefix("PROBE "))
    return found


def test_the_engine_hands_text_over_in_chunks_of_stream_tokens(model_dir: Path) -> None:
    found = _probe(model_dir, stream_tokens=4)
    # The first token comes at once, then every 4 (21 = 1 + 5 x 4); per token it made 21.
    assert found["tokens"] == [1, 4, 4, 4, 4, 4]
    assert found["completion_tokens"] == 21
    assert found["text"] == found["result_text"]
