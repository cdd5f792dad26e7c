"""The server's boundary (issue 37): strict JSON types (a 400 naming the field, never a lax
coercion), any string echoed in an error without a 500, the ``Host`` allow-list, and what the
clients users bring need: ``/v1/models/{id}``, ``x-request-id``, ``/tokenize`` and
``/detokenize``, the harmless fields they send by default, logprobs that join back into the
returned text. A real server on an ephemeral port; after each bad request the server's next
answer is unchanged."""

from __future__ import annotations

import json
import socket

import openai
import pytest
from test_openai_server import _post

from llmlab.serve import start_server
from llmlab.serve.config import ServerConfig
from llmlab.serve.middleware import host_allowed

MODEL = "shakespeare"
TIMEOUT = 60


@pytest.fixture(scope="module")
def server():
    with start_server(MODEL, max_num_seqs=8, num_gpu_blocks=256, block_size=8) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def _greedy(client) -> str:
    return client.completions.create(model=MODEL, prompt="KING:", max_tokens=8, temperature=0).choices[0].text


def _raw(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One raw HTTP/1.1 exchange (the request line and headers as given); status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as c:
        c.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        data = b""
        while chunk := c.recv(1 << 16):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


LAX = {  # field: values a lax server would coerce (JSON text, so NaN, bools and surrogates stay)
    "n": ["1.0", "true", '"1"'],
    "max_tokens": ['"4"', "4.0"],
    "seed": ["1.5", "true"],
    "temperature": ['"0"', "true"],
    "stream": ['"true"', "1"],
    "echo": ["1"],
    "logprobs": ["true", "1.0"],
    "stop": ["5", "[1]"],
    "model": ["5"],
    "stop_token_ids": ["[true]", "[1.5]", '["\\u0666\\u0665"]', '[" 65 "]'],
    "logit_bias": ['{"\\u0666\\u0665": 1}', '{" 65 ": 1}', '{"65": "1"}'],
    "prompt": ["[true, 65]", "[65.0]", '["65", 1]', '[["\\u0666\\u0665"]]', "5"],
    "ignore_eos": ["0"],
    "min_tokens": ["1.0"],
    "user": ["5"],
    "store": ['"yes"'],
}


def test_lax_types_are_400_naming_the_field(server, client):
    before = _greedy(client)
    url = server.url + "/v1/completions"
    for field, values in LAX.items():
        for v in values:
            body = '{"model": "shakespeare", "prompt": "x", "max_tokens": 4, "%s": %s}' % (field, v)
            if field in ("model", "prompt"):
                body = '{"prompt": "x", "max_tokens": 4, "%s": %s}' % (field, v)
            code, err = _post(url, body.encode())
            assert code == 400, (field, v, err)
            assert err["error"]["param"].split(".")[0] == field, (field, v, err)
    chat = server.url + "/v1/chat/completions"
    for text in ("null", "5", '{"a": 1}', '["x"]', "true"):
        body = (
            '{"model": "shakespeare", "max_tokens": 2, "messages": [{"role": "user", '
            '"content": [{"type": "text", "text": %s}]}]}' % text
        )
        code, err = _post(chat, body.encode())
        assert code == 400 and err["error"]["param"] == "messages.0.content.0.text", (text, err)
    for content, param in (
        ("5", "messages.0.content"),
        ("[5]", "messages.0.content.0"),
        ('[{"type": "text", "text": "a", "extra": 1}]', "messages.0.content.0.extra"),
        ('[{"type": "input_audio", "input_audio": {}}]', "messages.0.content.0.type"),
        ('[{"type": "image_url", "image_url": {"url": "data:,"}}]', "messages"),
    ):  # text-only model
        body = (
            '{"model": "shakespeare", "max_tokens": 2, "messages": [{"role": "user", '
            '"content": %s}]}' % content
        )
        code, err = _post(chat, body.encode())
        assert code == 400 and err["error"]["param"] == param, (content, err)
    code, err = _post(
        chat,
        {
            "model": MODEL,
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous": True},
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert code == 400 and err["error"]["param"] == "stream_options.continuous", err
    assert _greedy(client) == before


def test_any_string_is_echoed_in_an_error_without_a_500(server, client):
    before = _greedy(client)
    url = server.url + "/v1/completions"
    for body, param in (
        ('{"model": "\\ud800", "prompt": "x"}', "model"),
        ('{"model": "shakespeare", "prompt": "a\\udfffb"}', "prompt"),
        ('{"model": "shakespeare", "prompt": "x", "stop": ["\\ud83d"]}', "stop.0"),
        ('{"model": "shakespeare", "prompt": "x", "\\udc00": 1}', "\udc00"),
        ('{"model": "shakespeare", "prompt": "x", "user": "\\udc00"}', "user"),
    ):
        code, err = _post(url, body.encode())
        assert code == 400 and err["error"]["param"] == param, (body, err)
    code, err = _post(url, {"model": "no-such-\u00e9\u4e2d", "prompt": "x"})
    assert code == 404 and "no-such-\u00e9\u4e2d" in err["error"]["message"]
    code, err = _post(
        server.url + "/v1/chat/completions",
        b'{"model": "shakespeare", "messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "x", "\\udc00": 1}]}]}',
    )
    assert code == 400 and err["error"]["param"].startswith("messages.0.content.0")
    assert _greedy(client) == before


def test_foreign_host_headers_are_refused(server, client):
    before = _greedy(client)
    body = json.dumps({"model": MODEL, "prompt": "KING:", "max_tokens": 8, "temperature": 0}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
    for host in (
        b"evil.example",
        b"evil.example:%d" % server.port,
        b"127.0.0.1.evil.example",
        b"localhost.evil.example",
        b"[::2]:80",
        b"localhost:80@evil",
    ):
        code, out = _raw(server.port, head % host, body)
        assert code == 400 and json.loads(out)["error"]["param"] == "host", (host, out)
    code, out = _raw(server.port, b"GET /health HTTP/1.0\r\n")  # no Host at all
    assert code == 400
    for host in (b"localhost", b"LOCALHOST:%d" % server.port, b"127.0.0.1:1", b"[::1]:8000"):
        code, out = _raw(server.port, head % host, body)
        assert code == 200 and json.loads(out)["choices"][0]["text"] == before, host
    assert _greedy(client) == before


def test_allowed_hosts_defaults_and_matching():
    assert ServerConfig().hosts_for("127.0.0.1") == ("localhost", "127.0.0.1", "[::1]")
    assert ServerConfig().hosts_for("::1") == ("localhost", "127.0.0.1", "[::1]")
    assert ServerConfig().hosts_for("0.0.0.0") == ("*",)
    assert ServerConfig(allowed_hosts=("Lab.Example",)).hosts_for("0.0.0.0") == ("lab.example",)
    allowed = ("lab.example", "other.example:8443")
    assert host_allowed("lab.example:8000", allowed) and host_allowed("LAB.example", allowed)
    assert host_allowed("other.example:8443", allowed)
    assert not host_allowed("other.example:80", allowed)
    assert not host_allowed("sub.lab.example", allowed) and not host_allowed("", allowed)
    assert host_allowed("anything", ("*",))
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServerConfig(allowed_hosts=()).validate()
    with pytest.raises(ValueError, match="stream_timeout_s"):
        ServerConfig(stream_timeout_s=float("nan")).validate()
    from llmlab.cli import build_parser
    from llmlab.serve import cli as serve_cli

    for flags, named in (
        (["--stream-timeout-s", "0"], "--stream-timeout-s 0.0 must"),
        (["--max-concurrent-streams", "0"], "--max-concurrent-streams 0 must"),
    ):
        with pytest.raises(ValueError, match=named):
            serve_cli.validate(build_parser().parse_args(["serve", *flags]))
    args = build_parser().parse_args(["serve", "--allowed-hosts", "lab.example", "*"])
    assert serve_cli.server_config(args).hosts_for("127.0.0.1") == ("lab.example", "*")


def test_model_route_request_ids_and_tokenizer_routes(server, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="KING:", max_tokens=2, extra_headers={"x-request-id": "abc-123"}
    )
    assert raw.headers["x-request-id"] == "abc-123" and raw.parse().id == "cmpl-abc-123"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
    )
    rid = raw.headers["x-request-id"]
    assert len(rid) == 32 and raw.parse().id == f"chatcmpl-{rid}"
    code, tok = _post(
        server.url + "/tokenize", {"model": MODEL, "prompt": "ROMEO:", "return_token_strs": True}
    )
    assert code == 200 and tok["tokens"] == list(b"ROMEO:") and tok["count"] == 6
    assert "".join(tok["token_strs"]) == "ROMEO:" and tok["max_model_len"] == 512
    code, back = _post(server.url + "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
    assert code == 200 and back == {"prompt": "ROMEO:"}
    msgs = [{"role": "user", "content": "Speak."}]
    code, tok = _post(server.url + "/tokenize", {"messages": msgs})
    usage = client.chat.completions.create(model=MODEL, max_tokens=1, messages=msgs).usage
    assert code == 200 and tok["count"] == usage.prompt_tokens
    for body, param in (
        ({"tokens": [1, True]}, "tokens"),
        ({"tokens": [1.0]}, "tokens"),
        ({"tokens": [10**6]}, "tokens"),
        ({"tokens": [1], "x": 1}, "x"),
    ):
        code, err = _post(server.url + "/detokenize", body)
        assert code == 400 and err["error"]["param"].split(".")[0] == param, (body, err)


def test_harmless_client_fields_are_accepted(server, client):
    before = _greedy(client)
    extra = dict(
        store=False,
        metadata={"run": "1"},
        service_tier="auto",
        user="u",
        safety_identifier="s",
        prompt_cache_key="k",
    )
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=8,
        temperature=0,
        response_format={"type": "text"},
        **extra,
        messages=[{"role": "user", "content": "x", "name": "bob"}],
    )
    plain = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "x"}]
    )
    assert r.choices[0].message.content == plain.choices[0].message.content
    got = (
        client.completions.create(model=MODEL, prompt="KING:", max_tokens=8, temperature=0, extra_body=extra)
        .choices[0]
        .text
    )
    assert got == before
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "x"}],
        )


def _first_tokens(client, prompt: str, n: int) -> list[int]:
    lp = (
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, logprobs=0)
        .choices[0]
        .logprobs
    )
    return [ord(t) for t in lp.tokens]  # the byte tokenizer: one character per token


def test_logprobs_join_back_into_the_text(server, client):
    prompt = "ROMEO:"
    toks = _first_tokens(client, prompt, 12)
    stop_id = toks[5]  # an "end-of-turn" token: left out of the text
    stop_str = bytes(toks[7:9]).decode()  # a stop string: the text ends before it
    cases = [dict(extra_body={"stop_token_ids": [stop_id]}), dict(stop=[stop_str]), dict()]
    for kw in cases:
        for echo in (False, True):
            r = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, echo=echo, **kw
            ).choices[0]
            lp = r.logprobs
            assert "".join(lp.tokens) == r.text, (kw, echo, lp.tokens, r.text)
            assert all(0 <= o < max(len(r.text), 1) for o in lp.text_offset)
            assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
            chunks = list(
                client.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=12,
                    temperature=0,
                    logprobs=2,
                    echo=echo,
                    stream=True,
                    **kw,
                )
            )
            streamed = [
                t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
            ]
            assert streamed == lp.tokens, (kw, echo)
        chat = client.chat.completions.create(
            model=MODEL,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            messages=[{"role": "user", "content": prompt}],
            **kw,
        ).choices[0]
        assert "".join(e.token for e in chat.logprobs.content) == chat.message.content
    short = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=1,
        extra_body={"stop_token_ids": [stop_id]},
    ).choices[0]
    assert short.finish_reason == "stop" and len(short.logprobs.tokens) == 5
