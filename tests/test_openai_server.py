"""``llmlab serve``: a real server on an ephemeral 127.0.0.1 port, spoken to with the official
``openai`` client and raw HTTP. Every wait is bounded; fixtures always stop the servers."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import openai  # noqa: E402  (the dev extra installs it, with the serve extra)

from llmlab.cli import main  # noqa: E402
from llmlab.inference import LLM, SamplingParams  # noqa: E402
from llmlab.serve import start_server  # noqa: E402
from llmlab.serve.chat import ChatRenderer, load_template  # noqa: E402
from llmlab.serve.metrics import METRIC_NAMES  # noqa: E402
from llmlab.serve.load_test import parse_rates  # noqa: E402
from llmlab.serve.router import least_loaded  # noqa: E402

MODEL = "shakespeare"
TIMEOUT = 60


@pytest.fixture(scope="module")
def server():
    with start_server(MODEL, max_num_seqs=16, num_gpu_blocks=256, block_size=8) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL)


def _wait(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _pool_is_full(server) -> bool:
    return all(
        e.num_in_flight == 0
        and not e.engine.has_unfinished_requests()
        and e.engine.block_manager.num_used_blocks == 0
        for e in server.engines
    )


def _post(url: str, body, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str, headers=None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=TIMEOUT) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_greedy_completion_equals_llmlab_generate_and_stream(server, client, tmp_path):
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                "--prompt",
                "ROMEO:",
                "--temperature",
                "0",
                "--max-tokens",
                "24",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    want = json.loads(out.read_text())["text"]
    r = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=24, temperature=0)
    assert r.choices[0].text == want and len(want) > 0
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 24, 30)

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="ROMEO:",
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == want
    assert len(text_chunks) > 1
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in text_chunks)


def test_chat_uses_plain_template_and_streams_n_choices(server, client, llm):
    messages = [
        {"role": "system", "content": "Speak as a king."},
        {"role": "user", "content": "Who goes there?"},
    ]
    text, ids = ChatRenderer(llm.engine.tokenizer).render(messages)
    assert text == "system: Speak as a king.\nuser: Who goes there?\nassistant:"
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, n=3, temperature=0.9, seed=5, stream=True
    )
    seen = {0: [], 1: [], 2: []}
    for c in stream:
        (choice,) = c.choices
        seen[choice.index].append(choice)
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, n=3, temperature=0.9, seed=5
    )
    for i, chs in seen.items():
        assert chs[0].delta.role == "assistant"
        assert [c.finish_reason for c in chs] == [None] * (len(chs) - 1) + ["length"]
        assert "".join(c.delta.content or "" for c in chs) == whole.choices[i].message.content
    assert len({c.message.content for c in whole.choices}) > 1  # samples differ
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_32_concurrent_requests_complete_with_the_batch_free_answers(server, client, llm):
    prompts = [
        f"{name}:" for name in ("ROMEO", "JULIET", "KING", "LEAR", "HAMLET", "MACBETH", "OTHELLO", "PUCK")
    ] * 4
    lens = [4 + (i % 7) for i in range(32)]
    want = [
        o.outputs[0].text
        for o in llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lens])
    ]

    def one(i):
        return (
            client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lens[i], temperature=0)
            .choices[0]
            .text
        )

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32), timeout=TIMEOUT))
    assert got == want
    _wait(lambda: _pool_is_full(server), "the block pool to be full again")


def test_cancelled_stream_frees_its_blocks(server, client):
    bm = server.engines[0].engine.block_manager
    stream = client.completions.create(
        model=MODEL,
        prompt="ROMEO:",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert bm.num_used_blocks > 0
    stream.close()
    _wait(lambda: _pool_is_full(server), "the aborted request's blocks to return")
    assert bm.num_free_blocks == bm.num_blocks
    _, body = _get(server.url + "/metrics")
    assert 'llmlab:request_success_total{finished_reason="abort"' in body.decode()


def test_bad_requests_get_400_class_errors_and_the_server_still_answers(server, client):
    url = server.url + "/v1/completions"
    before = (
        client.completions.create(model=MODEL, prompt="KING:", max_tokens=8, temperature=0).choices[0].text
    )
    cases = [
        (b'{"model": "shakespeare", "prompt": ', 400),  # malformed JSON
        ({"model": "nope", "prompt": "x"}, 404),  # unknown model
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, 400),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
        ({"model": MODEL, "prompt": "x", "n": 0}, 400),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400),
        ({"model": MODEL, "prompt": "x" * 600, "max_tokens": 4}, 400),  # > max_model_len 512
        ({"model": MODEL, "prompt": "x" * 500, "max_tokens": 100}, 400),  # prompt + max_tokens
        ({"model": MODEL, "prompt": [1, 2, 999]}, 400),  # token id >= vocab
        ({"model": MODEL, "prompt": ""}, 400),  # empty prompt
        ({"model": MODEL}, 400),  # no prompt
        ({"model": MODEL, "prompt": "x", "best_of": 3}, 400),  # unsupported
        ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400),
    ]
    for body, status in cases:
        code, err = _post(url, body)
        assert code == status, (body, err)
        assert err["error"]["code"] == status and err["error"]["message"]
        assert err["error"]["type"] in ("BadRequestError", "NotFoundError")
    code, err = _post(server.url + "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert code == 400
    code, err = _post(
        server.url + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
    )
    assert code == 400
    code, err = _post(
        server.url + "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}
    )  # no content
    assert code == 400 and "needs 'content'" in err["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    after = (
        client.completions.create(model=MODEL, prompt="KING:", max_tokens=8, temperature=0).choices[0].text
    )
    assert after == before
    assert _get(server.url + "/health")[0] == 200
    _wait(lambda: _pool_is_full(server), "an idle pool")


def test_metrics_export_vllm_names(server, client):
    client.completions.create(model=MODEL, prompt="PUCK:", max_tokens=5, temperature=0)
    code, body = _get(server.url + "/metrics")
    text = body.decode()
    assert code == 200
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    for name in METRIC_NAMES:
        assert any(line.startswith(f"llmlab:{name}") for line in samples), name
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert f"# TYPE llmlab:{name} histogram" in text
    lab = '{model_name="shakespeare",replica="0"}'
    values = {line.split()[0]: float(line.split()[1]) for line in samples}
    assert values[f"llmlab:generation_tokens_total{lab}"] >= 5
    assert values[f"llmlab:prompt_tokens_total{lab}"] >= 5
    assert values[f"llmlab:time_to_first_token_seconds_count{lab}"] >= 1
    assert values[f"llmlab:kv_cache_usage_perc{lab}"] == 0.0
    assert 0.0 < values[f"llmlab:engine_busy_perc{lab}"] <= 1.0


def test_api_key_and_full_waiting_queue():
    with start_server(
        MODEL, api_key="sesame", max_num_seqs=1, max_waiting_requests=1, num_gpu_blocks=128, block_size=8
    ) as s:
        assert _get(s.url + "/v1/models")[0] == 401
        assert _get(s.url + "/v1/models", {"Authorization": "Bearer wrong"})[0] == 401
        assert _get(s.url + "/health")[0] == 200
        for route in ("/metrics", "/docs", "/redoc", "/openapi.json", "/nowhere"):
            assert _get(s.url + route)[0] == 401, route  # only /health is open
        key = {"Authorization": "Bearer sesame"}
        assert _get(s.url + "/metrics", key)[0] == 200 and _get(s.url + "/openapi.json", key)[0] == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0, timeout=TIMEOUT)
        eng = s.engines[0].engine
        running = c.completions.create(
            model=MODEL, prompt="A:", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        it = iter(running)
        next(it)  # A holds the one running slot
        waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
            c.completions.create, model=MODEL, prompt="B:", max_tokens=3, temperature=0
        )
        _wait(lambda: len(eng.scheduler.waiting) == 1, "B to wait")
        with pytest.raises(openai.APIStatusError) as e:  # C: the waiting queue is full
            c.completions.create(model=MODEL, prompt="C:", max_tokens=3)
        assert e.value.status_code == 503
        running.close()  # A aborted: B runs
        assert len(waiting.result(timeout=TIMEOUT).choices[0].text) > 0
        _wait(lambda: _pool_is_full(s), "the pool to be free")


def test_least_loaded_routing():
    assert least_loaded([3, 1, 2]) == 1
    assert least_loaded([1, 1, 1], start=2) == 2
    assert least_loaded([0, 2, 0], start=1) == 2
    with pytest.raises(ValueError):
        least_loaded([])


def test_cli_refuses_a_taken_port_before_loading_the_model(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.perf_counter()
        assert main(["serve", "--port", str(port)]) == 2
        assert time.perf_counter() - t0 < 10  # no engine was built
    err = capsys.readouterr().err
    assert f"llmlab serve: error: cannot listen on 127.0.0.1:{port}" in err
    assert "--port 0 picks a free port" in err and "Traceback" not in err


def test_cli_serves_and_sigterm_lets_the_running_stream_finish():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmlab",
            "serve",
            "--port",
            "0",
            "--max-num-seqs",
            "4",
            "--shutdown-timeout",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        assert line and "serving shakespeare at http://127.0.0.1:" in line[0], proc.stderr.read()
        url = line[0].split(" at ")[1].split()[0]
        assert _get(url + "/health")[0] == 200
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        stream = c.completions.create(
            model=MODEL,
            prompt="ROMEO:",
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        it = iter(stream)
        first = next(it)
        proc.send_signal(signal.SIGTERM)  # stop admitting; finish A
        rest = list(it)
        assert rest[-1].choices[0].finish_reason == "length"
        text = "".join(ch.choices[0].text for ch in [first] + rest)
        assert proc.wait(timeout=60) == 0
        want = (
            LLM(MODEL)
            .generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
            .outputs[0]
            .text
        )
        assert text == want
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_disconnected_non_streamed_request_is_aborted(server):
    import socket

    body = json.dumps({"model": MODEL, "prompt": "ROMEO:", "max_tokens": 450, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    eng = server.engines[0]
    _wait(lambda: eng.engine.block_manager.num_used_blocks > 0, "the request to run")
    sock.close()  # the client goes away
    _wait(lambda: _pool_is_full(server), "the abandoned request to be aborted")
    assert eng.engine.requests == {}


def test_data_parallel_replicas_and_the_http_load_benchmark(tmp_path, llm):
    with start_server(MODEL, data_parallel_size=2, num_gpu_blocks=128, block_size=8) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        prompts = ["ROMEO:", "JULIET:", "KING:", "PUCK:"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(
                pool.map(
                    lambda p: (
                        c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
                        .choices[0]
                        .text
                    ),
                    prompts,
                )
            )
        want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))]
        assert got == want
        out = tmp_path / "bench.json"
        assert (
            main(
                [
                    "bench",
                    "serve",
                    "--endpoint",
                    s.url,
                    "--request-rate",
                    "50,inf",
                    "--num-requests",
                    "8",
                    "--output-len-median",
                    "6",
                    "--prompt-len-median",
                    "8",
                    "--slo-ttft",
                    "1e-6",
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        res = json.loads(out.read_text())
        assert [r["request_rate"] for r in res["rates"]] == [50.0, float("inf")]
        for r in res["rates"]:
            assert (r["completed"], r["failed"]) == (8, 0)
            assert r["num_output_tokens"] == sum(res["workload"]["output_lens"])
            assert r["goodput_requests_per_s"] == 0.0  # nobody meets a 1 us TTFT
            assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] <= r["e2e_s"]["p99"]
        _, body = _get(s.url + "/metrics")
        lines = body.decode().splitlines()
        for rep in ("0", "1"):  # both replicas served requests
            key = f'llmlab:e2e_request_latency_seconds_count{{model_name="shakespeare",replica="{rep}"}}'
            assert float(next(x for x in lines if x.startswith(key)).split()[1]) >= 1
        _wait(lambda: _pool_is_full(s), "both pools to be free")
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, float("inf")]
    with pytest.raises(ValueError, match="must be > 0"):
        parse_rates("1,0")
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--endpoint", "http://127.0.0.1:9", "--request-rate", "x"])


def test_engines_stepping_on_two_threads_do_not_share_a_forward_context(llm):
    """Data-parallel replicas step on their own threads in one process: each forward must see its
    own engine's paged-attention context."""
    prompts = ["ROMEO:", "JULIET: O", "KING LEAR:", "PUCK"] * 2
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engines = [LLM(MODEL, block_size=8), LLM(MODEL, block_size=4)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(
            pool.map(
                lambda e: [o.outputs[0].token_ids for o in e.generate(prompts, params)],
                engines,
                timeout=TIMEOUT,
            )
        )
    assert got == [want, want]


def test_logprobs_are_the_engines(server, client, llm):
    ref = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0].outputs[0]
    want = [d[t].logprob for t, d in zip(ref.token_ids, ref.logprobs)]
    r = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    # fp32: the server's step may batch the prompt with other rows (another GEMM shape), so the
    # same log-probabilities agree to rounding, not bit for bit
    assert lp.token_logprobs == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) == 2 for t in lp.top_logprobs)  # greedy: the sampled token is the top one
    streamed = [
        x
        for ch in client.completions.create(
            model=MODEL, prompt="ROMEO:", max_tokens=6, temperature=0, logprobs=2, stream=True
        )
        for x in ch.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(want, rel=1e-5, abs=1e-6)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == max(t.logprob for t in content[0].top_logprobs)  # greedy = top 1
    code, err = _post(server.url + "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 99})
    assert code == 400 and err["error"]["param"] == "logprobs"


def _hf_checkpoint_with_chat_template(path):
    """A tiny random HF Llama with a word-level tokenizer that has its own chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"] + [
        f"w{i}" for i in range(121)
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(str(path))
    cfg = transformers.LlamaConfig(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path, fast


def test_chat_uses_the_tokenizers_template_or_a_template_file(tmp_path):
    path, tok = _hf_checkpoint_with_chat_template(tmp_path / "wordy")
    messages = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w1 w2 w3"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|> w5 w6 <|user|> w1 w2 w3 <|assistant|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 8  # 3 role tags + 5 words
    engine_text = (
        LLM(str(path)).generate([ids], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    )
    with start_server(str(path), num_gpu_blocks=64, block_size=8) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        assert [m.id for m in c.models.list().data] == ["wordy"]  # the folder's name
        r = c.chat.completions.create(model="wordy", messages=messages, max_tokens=6, temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == engine_text
    # --chat-template FILE overrides the tokenizer's
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}<|assistant|>")
    text, got = ChatRenderer(tok, load_template(str(f))).render(messages)
    assert text == "w5 w6 w1 w2 w3 <|assistant|>" and tok.decode(got) == text
    with pytest.raises(FileNotFoundError):
        load_template(str(tmp_path / "missing.jinja"))


def test_the_engines_other_sampling_fields_pass_through(server, client, llm):
    kw = {"repetition_penalty": 1.8, "min_tokens": 4, "presence_penalty": 0.5}
    want = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=16, **kw))[0].outputs[0].text
    plain = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    got = (
        client.completions.create(
            model=MODEL,
            prompt="ROMEO:",
            max_tokens=16,
            temperature=0,
            presence_penalty=0.5,
            extra_body={"repetition_penalty": 1.8, "min_tokens": 4},
        )
        .choices[0]
        .text
    )
    assert got == want != plain
    code, err = _post(
        server.url + "/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": -1}
    )
    assert code == 400 and "repetition_penalty" in err["error"]["message"]


def test_a_routing_policy_chooses_the_replica():
    picked = []

    def always_the_second(loads, start):
        picked.append(list(loads))
        return 1

    with start_server(
        MODEL, data_parallel_size=2, num_gpu_blocks=64, block_size=8, routing_policy=always_the_second
    ) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        for p in ("ROMEO:", "JULIET:"):
            c.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0)
        assert s.app.state.router.policy is always_the_second
        _, body = _get(s.url + "/metrics")
    counts = {
        ln.split('replica="')[1][0]: float(ln.split()[1])
        for ln in body.decode().splitlines()
        if ln.startswith("llmlab:e2e_request_latency_seconds_count{")
    }
    assert counts.get("1") == 2 and counts.get("0", 0) == 0, counts
    assert len(picked) == 2 and all(len(loads) == 2 for loads in picked)
