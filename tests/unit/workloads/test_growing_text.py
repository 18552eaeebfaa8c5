"""hf_serving.GrowingText: the text of a growing token list equals decoding the whole list
whenever that does not end in an incomplete character, for the two decoder styles checkpoints
ship (byte-level BPE as GPT-2/Qwen/OLMoE, metaspace with byte fallback as Llama/Mixtral),
through multi-byte characters, byte runs that are not valid UTF-8, special tokens, and several
tokens added at once (a tool's forced text)."""

from __future__ import annotations

import random

import pytest

from sparsegate_workload.hf import build_tiny_tokenizer
from sparsegate_workload.hf_serving import GrowingText, decode

TEXTS = ["hello world, this is a tiny test", "naïve café — 数字 12 + 30 = 42 🙂🙂",
         "  leading spaces and trailing  ", "a,b.c;d", "emoji 👩‍💻 joins; ∑ x² ≥ 0"]


def metaspace_tokenizer():
    """A Llama-style tokenizer built in code: BPE over "▁"-joined words with byte fallback
    (<0xNN> tokens for what the vocabulary lacks) and Llama's decoder, which turns "▁" into a
    space and strips the first one."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz,.;+=", "▁t", "▁a", "he", "ll", "▁he", "▁hell", "o", "▁w"]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    merges = [("▁", "t"), ("▁", "a"), ("h", "e"), ("l", "l"), ("▁", "he"), ("▁he", "ll"), ("▁", "w")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def tokenizer(request):
    return build_tiny_tokenizer() if request.param == "byte-level" else metaspace_tokenizer()


def _grow(tokenizer, ids: list[int], rng: random.Random) -> None:
    text = GrowingText(tokenizer)
    at = 0
    while at < len(ids):
        step = 1 if rng.random() < 0.8 else rng.randint(2, 5)  # now and then several at once
        got = text.extend(ids[at:at + step])
        at = min(len(ids), at + step)
        whole = decode(tokenizer, ids[:at])
        if whole.endswith("\ufffd"):
            # A character still incomplete: both end in "\ufffd" (what a stream holds back). Byte
            # fallback renders the whole byte run so, characters already complete in it included,
            # which the grown text keeps: they come back in the whole decode once it completes.
            assert got.endswith("\ufffd"), (ids[:at], got)
        else:
            assert got == whole, (ids[:at], got)
    assert text.ids == ids


def test_grown_text_is_the_whole_decode_at_every_step_for_real_text(tokenizer):
    rng = random.Random(0)
    specials = [tokenizer.bos_token_id, tokenizer.eos_token_id]
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert any(decode(tokenizer, ids[:k]).endswith("\ufffd") for k in range(len(ids))) or text.isascii()
        for _ in range(5):
            mixed = list(ids)
            for _ in range(3):  # special tokens anywhere decode to nothing
                mixed.insert(rng.randrange(len(mixed) + 1), rng.choice(specials))
            _grow(tokenizer, mixed, rng)


def test_grown_text_is_the_whole_decode_for_any_ids(tokenizer):
    """Arbitrary ids, including byte runs that never form a character ("\ufffd" in the text)."""
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        _grow(tokenizer, ids, rng)


def test_nothing_added_changes_nothing():
    tok = build_tiny_tokenizer()
    text = GrowingText(tok)
    assert text.extend([]) == ""
    ids = tok("hi there", add_special_tokens=False)["input_ids"]
    assert text.extend(ids) == "hi there" == text.extend([])
