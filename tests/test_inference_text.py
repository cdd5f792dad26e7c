"""Output text as Hugging Face decodes it (issue 18): ``decode(prompt + output) - decode(prompt)``,
for a SentencePiece-style tokenizer ("▁" word boundaries, byte fallback: Llama 2, Mistral) and a
byte-level BPE one (GPT-2, Llama 3, Qwen2), both built offline here; streaming only appends
(never half a UTF-8 character); stop strings that begin with a space fire."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from llmlab.inference import LLM, SamplingParams
from llmlab.inference.detokenizer import IncrementalDetokenizer

TEXTS = [
    "the cat sat on the mat",
    "héllo wörld 中文 😀 ok",
    "a cat, the mat; é中 😀 sat",
    "stop the world",
    "on on on the mat",
]


def sentencepiece_tokenizer():
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = [
        "▁",
        "▁the",
        "▁a",
        "▁cat",
        "▁sat",
        "▁on",
        "▁mat",
        "▁hello",
        "▁world",
        "s",
        "ing",
        "▁é",
        "t",
        "h",
        "e",
        "c",
        "a",
        "o",
        "n",
        "m",
        "w",
        "r",
        "l",
        "d",
        "▁stop",
        ",",
    ]
    specials, byte_pieces = pieces[:3], pieces[3:]  # byte fallback last: see checkpoint()
    vocab = (
        [(p, 0.0) for p in specials]
        + [(w, -1.0 - 0.1 * i) for i, w in enumerate(words)]
        + [(p, 0.0) for p in byte_pieces]
    )
    tk = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def byte_level_tokenizer():
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(TEXTS * 3, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|end|>")


TOKENIZERS = {"sentencepiece": sentencepiece_tokenizer, "byte_level": byte_level_tokenizer}


def reference(tok, prompt, out, skip=True):
    full = tok.decode(prompt + out, skip_special_tokens=skip)
    head = tok.decode(prompt, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_incremental_detokenizer_equals_decode_of_prompt_plus_output(kind):
    tok = TOKENIZERS[kind]()
    rng = random.Random(0)
    for trial in range(40):
        prompt = tok.encode(rng.choice(TEXTS), add_special_tokens=False)
        if trial % 2:  # outputs as the model would write text
            out = tok.encode(" " + rng.choice(TEXTS), add_special_tokens=False)
        else:  # random characters (multi-byte ones split over tokens), special tokens
            out = []
            for _ in range(rng.randrange(1, 12)):
                out += tok.encode(
                    "".join(rng.choice("ab cé中😀 ,") for _ in range(3)), add_special_tokens=False
                )
                if rng.random() < 0.2:
                    out.append(tok.eos_token_id)
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, prompt, skip)
            shown = []
            for t in out:
                det.add(t)
                shown.append(det.text)
            det.finish()
            want = reference(tok, prompt, out, skip)
            assert det.text == want, (prompt, out)
            # append-only, and never a half character while more tokens may come
            assert all(b.startswith(a) for a, b in zip(shown, shown[1:] + [det.text]))
            assert "\ufffd" not in det.text
    sp = sentencepiece_tokenizer()
    p, o = sp.encode("the cat", add_special_tokens=False), sp.encode("sat", add_special_tokens=False)
    assert sp.decode(o) == "sat" and reference(sp, p, o) == " sat"  # the space decode(out) loses
    eos = sp.convert_tokens_to_ids("</s>")
    det = IncrementalDetokenizer(sp, p, skip_special_tokens=False)
    det.add(eos)
    assert "</s>" in det.text


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def checkpoint(request, tmp_path_factory):
    tok = TOKENIZERS[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    # A random model writes random bytes, mostly invalid UTF-8, where no text is well defined
    # (HF's byte fallback then rewrites earlier characters): the SentencePiece model's vocabulary
    # stops before the byte-fallback tokens (split multi-byte characters are checked above and in
    # the byte-level model's output).
    vocab = len(tok) if request.param == "byte_level" else tok.convert_tokens_to_ids("<0x00>")
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def test_engine_text_streaming_and_stop_strings(checkpoint):
    llm = LLM(str(checkpoint), device="cpu", block_size=4, check_invariants=True)
    tok = llm.engine.tokenizer
    prompts = ["the cat sat", "hello world", "on the mat, a cat"]
    sp = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True) for i in range(3)]
    final = llm.generate(prompts, sp)
    for p, o in zip(prompts, final):
        ids = tok.encode(p)
        assert o.prompt_token_ids == ids
        assert o.outputs[0].text == reference(tok, ids, o.outputs[0].token_ids)
    streamed = {}
    for o in llm.stream(prompts, sp):
        prev = streamed.get(o.prompt, "")
        assert o.outputs[0].text.startswith(prev)  # append-only
        streamed[o.prompt] = o.outputs[0].text
    assert [streamed[p] for p in prompts] == [o.outputs[0].text for o in final]
    # a stop string that begins with a space, cut from the text the first request makes
    text = final[0].outputs[0].text
    i = next(k for k in range(1, len(text) - 2) if text[k] == " " and text[k + 1] != " ")
    stop = text[i : i + 3]
    first = text.find(stop)
    got = llm.generate(
        prompts[0], SamplingParams(temperature=1.0, seed=0, max_tokens=30, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert got.finish_reason == "stop" and got.text == text[:first]
    kept = llm.generate(
        prompts[0],
        SamplingParams(
            temperature=1.0,
            seed=0,
            max_tokens=30,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0].outputs[0]
    assert kept.text == text[: first + len(stop)] and kept.token_ids == got.token_ids
