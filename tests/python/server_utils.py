"""Helpers for the server tests: a random tiny Llama with SmolLM2's tokenizer (byte-level BPE,
ChatML template; fast on 2 CPU cores, and its random tokens include partial UTF-8 byte tokens),
and a real `pagedllm serve` process on 127.0.0.1 at a free port."""

from __future__ import annotations

import atexit
import functools
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parents[2]


def package_root() -> str:
    """The folder that holds the `pagedllm` this test process imported (site-packages after
    `pip install`, python/ in a development build), so a subprocess runs the same build."""
    import pagedllm

    return str(Path(pagedllm.__file__).resolve().parents[1])
MAX_MODEL_LEN = 512


@functools.lru_cache(maxsize=None)
def tiny_model_dir() -> Path:
    """A random 2-layer Llama (hidden 128, 2 query heads / 1 KV head of 64, vocab 49,152) saved
    with SmolLM2-135M-Instruct's tokenizer and chat template; cached per process."""
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).parent))
    from _tokenizers import smollm2_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="pagedllm-tiny-server-"))
    atexit.register(lambda: __import__("shutil").rmtree(folder, ignore_errors=True))
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, vocab_size=49152, max_position_embeddings=MAX_MODEL_LEN,
        rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.08,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(str(folder))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m pagedllm serve MODEL --port P ...` in a subprocess (1 torch thread), waited
    for until /health answers 200."""

    def __init__(self, model: str, args: list[str], api_key: Optional[str] = None, timeout: float = 180.0):
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedllm", "serve", model, "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONPATH=package_root(), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   TOKENIZERS_PARALLELISM="false")
        self.log = tempfile.NamedTemporaryFile(prefix="pagedllm-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(ROOT))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start in {timeout} s:\n{self.read_log()[-4000:]}")
            time.sleep(0.5)

    def read_log(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "EMPTY", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "EMPTY", max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """/metrics parsed: {'name{labels}': value} plus {'name': value} for unlabelled lookups
        by name (the model_name label is dropped)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
            name = key.split("{", 1)[0]
            pairs = [p for p in re.findall(r'(\w+="[^"]*")', key[len(name):]) if not p.startswith("model_name=")]
            out[name + ("{" + ",".join(pairs) + "}" if pairs else "")] = float(value)
        return out

    def healthy(self, reference: Optional[tuple[dict, list[int]]] = None) -> bool:
        """The cases' "server still healthy": /health 200 within 5 s, /v1/models lists the
        model, and (given) a greedy reference request returns the same token ids as before."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if httpx.get(self.url + "/health", timeout=5).status_code != 200:
            return False
        models = httpx.get(self.url + "/v1/models", headers=headers, timeout=5).json()
        if not models.get("data"):
            return False
        if reference is not None:
            body, ids = reference
            got = httpx.post(self.url + "/v1/completions", json=body, headers=headers, timeout=60).json()
            return got["choices"][0]["token_ids"] == ids
        return True

    def spawned_children(self) -> list[int]:
        """Pids of the server's spawned child processes (its engine process, and its API server
        processes with --api-server-count > 1); not multiprocessing's resource tracker."""
        out = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                    out.append(int(child))
        return out

    def engine_pid(self) -> int:
        """The engine process's pid (its start-up log line), checked to be the server's child."""
        pid = int(re.search(r"engine core process (\d+) ready", self.read_log()).group(1))
        assert pid in self.spawned_children(), (pid, self.spawned_children())
        return pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_SHARED: dict[str, RemoteServer] = {}


def shared_server(name: str, args: list[str], api_key: Optional[str] = None) -> RemoteServer:
    """One server per name for the whole pytest process (stopped at exit)."""
    if name not in _SHARED:
        _SHARED[name] = RemoteServer(str(tiny_model_dir()), args, api_key=api_key)
        atexit.register(_SHARED[name].stop)
    server = _SHARED[name]
    if server.proc.poll() is not None:
        raise RuntimeError(f"the shared server {name!r} died:\n{server.read_log()[-4000:]}")
    return server


DEFAULT_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16",
                "--kv-cache-memory-bytes", "64MiB", "--max-num-seqs", "64", "--served-model-name", "tiny",
                "tiny-alias"]
