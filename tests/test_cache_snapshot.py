"""KV snapshots (runtime/scheduler/snapshot*.py): the file on its own (round trip, safetensors
compatibility, every refusal, atomic saves), then through the Engine (greedy outputs after a restart
equal a warm and a cold run, refusals start cold, saves while generating, chunked loads, dropped
nodes), then through a real server (save on shutdown, load at start-up, POST /cache/save|load)."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path

import pytest
import torch

from radixlm.runtime.scheduler import snapshot as snapshot_mod
from radixlm.runtime.scheduler.snapshot_file import SnapshotError, read_snapshot, write_snapshot

FP = {"radixlm": "test", "model_weights": "abc", "dtype": "float32"}
GREEDY = {"max_new_tokens": 12, "temperature": 0}


# --------------------------------------------------------------------------- the file alone
def fake_pool(slots: int = 64, layers: int = 2, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(slots + 1, 2, 4, generator=g) for _ in range(layers)],
            [torch.randn(slots + 1, 2, 4, generator=g) for _ in range(layers)])


def table(lengths: list[int], parents: list[int]) -> dict[str, torch.Tensor]:
    rows = sum(lengths)
    return {"tokens": torch.arange(1000, 1000 + rows), "parents": torch.tensor(parents),
            "lengths": torch.tensor(lengths), "hits": torch.tensor([5] + [1] * (len(lengths) - 1))}


# rows from a long run, a short run, scattered single slots and another long run (both kinds of piece)
SLOTS = torch.tensor(list(range(3, 23)) + [40, 41, 7 + 20, 60, 2] + list(range(42, 59)))


def write(path: Path, pool=None, valid=None, fp=FP) -> dict:
    k, v = pool or fake_pool()
    n = len(SLOTS)
    return write_snapshot(path, k, v, SLOTS, table([20, 5, n - 25], [-1, 0, 0]), fp,
                          lambda: valid or [True, True, True])


def read(path: Path, fp=FP):
    return read_snapshot(path, fp, 2, (2, 4), torch.float32)


def test_round_trip_and_any_safetensors_reader_opens_it(tmp_path):
    from safetensors import safe_open

    k, v = fake_pool()
    path = tmp_path / "snap.safetensors"
    figures = write(path, (k, v), valid=[True, False, True])
    assert figures["nodes"] == 2 and figures["dropped_nodes"] == 1 and figures["tokens"] == len(SLOTS) - 5
    data = read(path)
    try:
        assert data.parents == [-1, 0, 0] and data.lengths == [20, 5, len(SLOTS) - 25] and data.valid == [True, False,
                                                                                                          True]
        for layer in range(2):
            assert torch.equal(data.k[layer], k[layer][SLOTS]) and torch.equal(data.v[layer], v[layer][SLOTS])
        assert data.tokens.tolist() == list(range(1000, 1000 + len(SLOTS)))
    finally:
        data.close()
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["fingerprint"]) == FP
        assert torch.equal(f.get_tensor("v.1"), v[1][SLOTS])
    assert [p.name for p in tmp_path.iterdir()] == ["snap.safetensors"]  # no temporary file left


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, words", [
    ("fingerprint", "made by a different setup: model_weights"),
    ("truncated", "truncated"),
    ("flip-data", "checksum mismatch"),
    ("flip-header", None),
    ("flip-length", None),
    ("garbage", None),
    ("empty", "truncated"),
])
def test_damaged_or_foreign_files_are_refused(tmp_path, damage, words):
    path = tmp_path / "snap.safetensors"
    write(path)
    size = path.stat().st_size
    fp = FP
    if damage == "fingerprint":
        fp = {**FP, "model_weights": "other"}
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[: size - 100])
    elif damage == "flip-data":
        flip(path, size // 2)
    elif damage == "flip-header":
        flip(path, 60)
    elif damage == "flip-length":
        flip(path, 1)
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64 + b"not a snapshot" * 100)
    elif damage == "empty":
        path.write_bytes(b"")
    with pytest.raises(SnapshotError, match=words):
        read(path, fp)


def test_a_save_that_dies_midway_leaves_the_previous_snapshot_whole(tmp_path):
    path = tmp_path / "snap.safetensors"
    write(path)
    before = path.read_bytes()

    def crash():
        raise RuntimeError("killed while writing")

    with pytest.raises(RuntimeError, match="killed"):
        write_snapshot(path, *fake_pool(seed=1), SLOTS, table([len(SLOTS)], [-1]), FP, crash)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["snap.safetensors"]
    read(path).close()


# --------------------------------------------------------------------------- through the Engine (tiny models)
def prompts(n: int = 3) -> list[str]:
    system = "You are the assistant of a small bakery. Answer in one short sentence. " * 6
    return [system + f"Customer {i} asks about bread number {i}." for i in range(n)]


@pytest.fixture(scope="module")
def tiny(make_tiny_model) -> Path:
    return make_tiny_model()


@pytest.fixture(scope="module")
def tiny_snapshot(tiny, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """A snapshot of the tiny model's cache after a few requests, and their greedy outputs."""
    from radixlm.runtime import Engine

    path = tmp_path_factory.mktemp("snap") / "tiny.safetensors"
    with Engine(model=str(tiny), log_level="warning") as e:
        outs = [o["output_ids"] for o in e.generate(prompts(), [GREEDY] * 3)]
        figures = e.save_cache(path)
        assert figures["ok"] and figures["tokens"] == e.get_server_info()["cache"]["evictable_size"]
    return path, outs


def cold_outputs(model: Path, **kwargs) -> list[list[int]]:
    """What a fresh engine answers (no snapshot): a refused snapshot must leave exactly this."""
    from radixlm.runtime import Engine

    with Engine(model=str(model), log_level="warning", **kwargs) as e:
        return [o["output_ids"] for o in e.generate(prompts(), [GREEDY] * 3)]


def tokenizer_variant(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    tok = json.loads((dest / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 49152, "content": "<|bakery|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (dest / "tokenizer.json").write_text(json.dumps(tok))
    return dest


@pytest.mark.parametrize("variant", ["other-model", "dtype", "tokenizer", "truncated", "flipped-byte"])
def test_engine_refuses_a_foreign_or_broken_snapshot_and_starts_cold(variant, tiny, tiny_snapshot, make_tiny_model,
                                                                    tmp_path, caplog):
    from radixlm.runtime import Engine

    good, _ = tiny_snapshot
    path = tmp_path / "snap.safetensors"
    shutil.copy(good, path)
    model, kwargs = tiny, {}
    if variant == "other-model":
        model = make_tiny_model(seed=1)
    elif variant == "dtype":
        kwargs = {"dtype": "bfloat16"}
    elif variant == "tokenizer":
        model = tokenizer_variant(tiny, tmp_path / "model")
    elif variant == "truncated":
        path.write_bytes(good.read_bytes()[:-1000])
    else:
        flip(path, path.stat().st_size - 5000)
    with caplog.at_level(logging.WARNING, logger="radixlm"):
        engine = Engine(model=str(model), log_level="warning", cache_snapshot=str(path), **kwargs)
    with engine as e:
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
        expected = {"other-model": "model_weights", "dtype": "dtype", "tokenizer": "tokenizer",
                    "truncated": "truncated", "flipped-byte": "checksum"}[variant]
        assert expected in refusals[0].getMessage()
        assert e.get_server_info()["cache"]["evictable_size"] == 0, "something from a refused snapshot was used"
        outs = e.generate(prompts(), [GREEDY] * 3)
        assert outs[0]["meta_info"]["cached_tokens"] == 0
        assert [o["output_ids"] for o in outs] == cold_outputs(model, **kwargs)
        e.flush_cache()
        with pytest.raises(SnapshotError, match=expected):
            e.load_cache(path)
        assert e.get_server_info()["cache"]["evictable_size"] == 0
        info = e.cache_info()["snapshot"]
        assert info["last_load"]["ok"] is False and info["last_load"]["error"] == "refused"


def special_path(kind: str, tmp_path: Path) -> Path:
    """A snapshot path that is no regular file: a FIFO (nothing ever writes to it), a device, a
    directory, or a symlink to /proc/self/mem (a 'regular' file of size 0 that refuses reads)."""
    import os

    path = tmp_path / f"{kind}.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/proc/self/mem")
    return path


@pytest.mark.parametrize("kind, words", [("fifo", "a FIFO"), ("device", "a character device"),
                                         ("directory", "a directory"), ("proc-mem", "truncated: 0 bytes")])
def test_snapshot_paths_that_are_no_regular_file_are_refused_without_blocking(kind, words, tiny, tmp_path, caplog):
    """At start-up a one-line refusal and a cold start; later loads refused the same way, saves never
    replace what is there. Nothing blocks: a FIFO is never opened for a read that waits for a writer."""
    import stat as stat_mod

    from radixlm.runtime import Engine

    path = special_path(kind, tmp_path)
    with caplog.at_level(logging.WARNING, logger="radixlm"):
        engine = Engine(model=str(tiny), log_level="warning", cache_snapshot=str(path))
    with engine as e:
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1 and words in refusals[0], [r.getMessage() for r in caplog.records]
        e.generate(prompts(), [GREEDY] * 3)
        with pytest.raises(SnapshotError, match=words):
            e.load_cache()
        if kind != "proc-mem":  # a save may replace a symlink to /proc (it replaces the link), never these
            with pytest.raises(SnapshotError, match=words.replace("truncated: 0 bytes", "")):
                e.save_cache()
        assert not e.cache_info()["snapshot"]["busy"]
    if kind == "fifo":
        assert stat_mod.S_ISFIFO(path.stat().st_mode), "the FIFO is still there, not replaced"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "no temporary file left behind"


def test_a_read_past_the_deadline_is_abandoned_and_frees_the_busy_flag(tiny, tiny_snapshot, monkeypatch):
    from radixlm.runtime import Engine

    stuck = threading.Event()
    real = snapshot_mod.read_snapshot
    monkeypatch.setattr(snapshot_mod, "read_snapshot", lambda *a: (stuck.wait(30), real(*a))[1])
    monkeypatch.setattr(snapshot_mod, "DEADLINE_S", 0.5)
    path, _ = tiny_snapshot
    with Engine(model=str(tiny), log_level="warning") as e:
        with pytest.raises(SnapshotError, match="abandoned"):
            e.load_cache(path)
        stuck.set()  # the reader finishes late: its data is closed, never used
        monkeypatch.setattr(snapshot_mod, "read_snapshot", real)
        assert e.load_cache(path)["tokens"] > 0, "the next load runs: the busy flag was freed"


def test_engine_load_in_small_chunks_and_into_a_small_pool(tiny, tiny_snapshot, monkeypatch):
    """A runtime load inserts a few tokens per loop iteration (edges split across iterations);
    into a pool too small for all of it, it keeps what fits."""
    from radixlm.runtime import Engine

    path, outs = tiny_snapshot
    monkeypatch.setattr(snapshot_mod, "LOAD_CHUNK_TOKENS", 7)
    with Engine(model=str(tiny), log_level="warning") as e:
        figures = e.load_cache(path)
        assert figures["ok"] and figures["tokens"] > 100 and not figures["pool_full"]
        res = e.generate(prompts(), [GREEDY] * 3)
        assert [o["output_ids"] for o in res] == outs
        # everything but the last prompt token (its logits are needed) came from the snapshot
        assert [o["meta_info"]["cached_tokens"] for o in res] == [len(e.tokenizer(p)["input_ids"]) - 1
                                                                  for p in prompts()]
        assert e.get_server_info()["kv_check"] == "ok"
    with Engine(model=str(tiny), log_level="warning", max_total_tokens=128) as e:
        figures = e.load_cache(path)
        assert figures["pool_full"] and 0 < figures["tokens"] <= 128
        assert e.generate(prompts(1)[0], GREEDY)["output_ids"] == outs[0]


def test_nodes_evicted_while_saving_are_marked_and_never_loaded(tiny, tmp_path, monkeypatch):
    from radixlm.runtime import Engine

    path = tmp_path / "snap.safetensors"
    with Engine(model=str(tiny), log_level="warning") as e:
        e.generate(prompts(), [GREEDY] * 3)
        cache = e.scheduler.cache
        real = cache.is_attached
        # the writer reads every row first; then the scheduler thread says which nodes stayed: here
        # all but the shared system prompt "left" meanwhile
        monkeypatch.setattr(cache, "is_attached", lambda node: real(node) and node.parent is cache.root)
        figures = e.save_cache(path)
        assert figures["dropped_nodes"] >= 3
    with Engine(model=str(tiny), log_level="warning", cache_snapshot=str(path)) as e:
        loaded = e.cache_info()["snapshot"]["last_load"]
        assert loaded["ok"] and loaded["skipped_nodes"] == figures["dropped_nodes"]
        assert loaded["tokens"] == figures["tokens"]
        out = e.generate(prompts(1)[0], GREEDY)
        assert 0 < out["meta_info"]["cached_tokens"] < len(e.tokenizer(prompts(1)[0])["input_ids"]) - 3


def test_saving_while_requests_run(tiny, tiny_snapshot, tmp_path):
    """The writer thread reads the pool while the scheduler keeps stepping: outputs do not change
    and the file is sound."""
    from radixlm.runtime import Engine

    _, outs = tiny_snapshot
    path = tmp_path / "snap.safetensors"
    with Engine(model=str(tiny), log_level="warning") as e:
        e.generate(prompts(), [GREEDY] * 3)
        results: dict = {}
        long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
        worker = threading.Thread(target=lambda: results.update(out=e.generate(prompts(3), [long] * 3)))
        worker.start()
        saves = [e.save_cache(path) for _ in range(3)]
        worker.join()
        assert all(s["ok"] and s["tokens"] > 0 for s in saves)
        assert [o["output_ids"][: len(x)] for o, x in zip(results["out"], outs)] == outs  # greedy: same start
    with Engine(model=str(tiny), log_level="warning", cache_snapshot=str(path)) as e:
        assert e.cache_info()["snapshot"]["last_load"]["ok"]
        res = e.generate(prompts(), [GREEDY] * 3)
        assert [o["output_ids"] for o in res] == outs and res[0]["meta_info"]["cached_tokens"] > 0


# --------------------------------------------------------------------------- the built-in model, a real restart
@pytest.mark.slow
def test_greedy_outputs_after_a_restart_equal_warm_and_cold(smollm_folder, tmp_path):
    from radixlm.runtime import Engine

    path = tmp_path / "smollm.safetensors"
    chat = [[{"role": "system", "content": "You are a terse travel agent. " * 30},
             {"role": "user", "content": f"Name one city in country number {i}."}] for i in range(3)]
    # fp16: its rows move with the cache only in their last bits (int4's bfloat16 rows move more: README)
    args = {"model": str(smollm_folder), "quantization": "fp16", "log_level": "warning", "max_total_tokens": 8192}
    with Engine(**args, cache_snapshot=str(path)) as e:
        texts = [e.apply_chat_template(m) for m in chat]
        e.generate(texts[0], GREEDY)  # warms the system prompt
        warm = e.generate(texts, [GREEDY] * 3)
        assert all(o["meta_info"]["cached_tokens"] > 150 for o in warm)
    # shutdown saved the cache (--cache-snapshot); start-up loads it
    with Engine(**args, cache_snapshot=str(path)) as e:
        first = e.generate(texts[1], GREEDY)
        assert first["meta_info"]["cached_tokens"] > 150, "the restored system prompt is not a hit"
        restored = [first] + e.generate([texts[0], texts[2]], [GREEDY] * 2)
        assert e.get_server_info()["kv_check"] == "ok"
    with Engine(**args, disable_radix_cache=True) as e:
        cold = e.generate(texts, [GREEDY] * 3)
    ids = lambda outs: [o["output_ids"] for o in outs]  # noqa: E731
    assert ids([restored[1], restored[0], restored[2]]) == ids(warm) == ids(cold)


# --------------------------------------------------------------------------- a real server
def chat(i: int) -> dict:
    return {"messages": [{"role": "system", "content": "You sell bread and only bread. " * 8},
                         {"role": "user", "content": f"What is loaf number {i}?"}], "max_tokens": 8, "temperature": 0}


@pytest.mark.slow
def test_server_saves_on_shutdown_loads_at_start_and_refuses_a_broken_file(tiny, tmp_path):
    import httpx
    from server_helpers import output_to

    from radixlm.server.launch import launch_server

    path = tmp_path / "server.safetensors"
    args = {"model": str(tiny), "port": 0, "log_level": "info", "cache_snapshot": str(path)}

    def ask(client: httpx.Client, i: int) -> tuple[str, int]:
        r = client.post("/v1/chat/completions", json=chat(i))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with launch_server(**args) as h, httpx.Client(base_url=h.url, timeout=120) as c:
        answers = [ask(c, i)[0] for i in range(2)]
        saved = c.post("/cache/save")
        assert saved.status_code == 200 and saved.json()["success"] and saved.json()["tokens"] > 0, saved.text
        answers.append(ask(c, 2)[0])  # after the explicit save: only the shutdown save has it
    with launch_server(**args) as h, httpx.Client(base_url=h.url, timeout=120) as c:
        assert c.get("/cache").json()["snapshot"]["last_load"]["ok"]
        for i in (2, 0):  # the first request after the restart is a hit, of the prompt saved on shutdown too
            text, cached = ask(c, i)
            assert cached > 50 and text == answers[i]
        r = c.post("/cache/load")  # again: everything is cached already
        assert r.status_code == 200 and r.json()["tokens"] == 0
    flip(path, path.stat().st_size // 2)
    log = tmp_path / "server.log"
    with output_to(log), launch_server(**args) as h, httpx.Client(base_url=h.url, timeout=120) as c:
        text, cached = ask(c, 1)
        assert text == answers[1] and cached == 0
        assert c.get("/cache").json()["snapshot"]["last_load"]["error"] == "refused"
        r = c.post("/cache/load")
        assert r.status_code == 409 and r.json()["error"]["code"] == "snapshot_refused"
        assert "checksum" in r.json()["error"]["message"]
    refusals = [line for line in log.read_text().splitlines() if "refused" in line]
    assert len(refusals) == 2 and "checksum mismatch" in refusals[0], refusals  # start-up, then POST /cache/load


@pytest.mark.slow
def test_server_with_a_fifo_as_snapshot_starts_cold_answers_and_stops(tiny, tmp_path):
    import httpx

    from radixlm.server.launch import launch_server

    path = special_path("fifo", tmp_path)
    with launch_server(model=str(tiny), port=0, log_level="warning", cache_snapshot=str(path)) as h, \
            httpx.Client(base_url=h.url, timeout=120) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/cache").json()["snapshot"]["last_load"]["error"] == "refused"
        assert c.post("/v1/chat/completions", json=chat(0)).status_code == 200  # something to save
        for route in ("/cache/load", "/cache/save"):
            r = c.post(route)
            assert r.status_code == 409 and "a FIFO" in r.json()["error"]["message"], r.text
        exit_code = h.shutdown()
    assert exit_code == 0 and path.is_fifo()
