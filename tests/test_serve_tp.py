"""`k3run serve` under torchrun: rank 0 serves HTTP, rank 1 mirrors its engine (gloo on CPU, bf16 model)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from k3run.cli import ASSETS_DIR  # noqa: E402
from tests.tp_utils import free_port, torchrun_env  # noqa: E402

MODEL_DIR = ASSETS_DIR / "default-model-bf16"
pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="no bundled bf16 model")


def _greedy(prompt: str, max_tokens: int) -> str:
    from k3run.api import load_model
    from k3run.engine import LLM, EngineConfig, SamplingParams
    from k3run.tokenizer import load_tokenizer

    model = load_model(MODEL_DIR, dtype=torch.float32)
    llm = LLM.from_model(model, load_tokenizer(MODEL_DIR), EngineConfig(max_model_len=128))
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


def test_serve_tensor_parallel_over_two_ranks():
    port, master = free_port(), free_port()
    cmd = [sys.executable, "-m", "k3run.cli", "serve", str(MODEL_DIR), "--port", port, "--device", "cpu"]
    cmd += ["--dtype", "fp32", "--max-model-len", "128", "--quiet"]
    procs = [
        subprocess.Popen(cmd, env=torchrun_env(r, 2, master, gloo=True), stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert all(p.poll() is None for p in procs), [
                p.stderr.read()[-2000:] for p in procs if p.poll() is not None
            ]
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.3)
        req = {"prompt": "def ", "max_tokens": 12, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=req, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _greedy("def ", 12)
        # several choices at once, and a bad request, keep both ranks in step
        assert httpx.post(url + "/v1/completions", json={"prompt": [1, 10**9]}, timeout=60).status_code == 400
        two = httpx.post(
            url + "/v1/completions", json=req | {"prompt": ["def ", "class "]}, timeout=60
        ).json()
        assert two["choices"][0]["text"] == r.json()["choices"][0]["text"]
        procs[0].send_signal(signal.SIGINT)  # uvicorn shuts down; rank 0 tells rank 1 to stop
        for p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
