"""A synthetic text corpus made in code, with easy and hard lines, and its tokenizer.

Nothing is downloaded: every line comes from a seeded `random.Random`. Each line is of one
*kind*, so evaluation can ask whether harder inputs get more experts (Huang et al., 2024):

- easy (predictable once started): counting runs ``count 12 13 14 15``, alphabet runs
  ``abc k l m n o``, a repeated phrase ``echo red fox red fox red fox`` and template sentences
  ``the big cat sees the old dog.`` over a few words per slot;
- hard (needs computation or long look-back): additions ``add 47+385=432``, reversals
  ``rev kqzt=tzqk`` and digit sorts ``sort 5291=1259``.

Every token is labelled with a `TokenClass`: easy, hard prompt (the random operands: nothing can
predict them) and hard answer (after ``=``: determined by the prompt, learnable but hard).

The tokenizer is byte-level BPE (any text encodes) trained on the corpus, with digits split one
per token so that numbers stay digit-level; ``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2 as in
`hf.tiny`.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import string
from typing import Any, Callable, Sequence

import torch

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ADJECTIVES = ("big", "old", "red", "small")
NOUNS = ("cat", "dog", "fox", "bird", "house", "tree")
VERBS = ("sees", "likes", "finds", "runs to")


class TokenClass(enum.IntEnum):
    EASY = 0          # a token of an easy line
    HARD_PROMPT = 1   # a hard line up to and including "=": random operands
    HARD_ANSWER = 2   # a hard line after "=": computed from the prompt


def _count(r: random.Random) -> str:
    start = r.randrange(0, 90)
    return "count " + " ".join(str(start + i) for i in range(r.randrange(4, 9)))


def _alphabet(r: random.Random) -> str:
    start = r.randrange(0, 18)
    return "abc " + " ".join(string.ascii_lowercase[start:start + r.randrange(4, 9)])


def _echo(r: random.Random) -> str:
    phrase = f"{r.choice(ADJECTIVES)} {r.choice(NOUNS)}"
    return "echo " + " ".join([phrase] * 3)


def _sentence(r: random.Random) -> str:
    return (f"the {r.choice(ADJECTIVES)} {r.choice(NOUNS)} {r.choice(VERBS)} "
            f"the {r.choice(ADJECTIVES)} {r.choice(NOUNS)}.")


def _add(r: random.Random) -> str:
    a, b = r.randrange(0, 1000), r.randrange(0, 1000)
    return f"add {a}+{b}={a + b}"


def _reverse(r: random.Random) -> str:
    word = "".join(r.choice(string.ascii_lowercase) for _ in range(r.randrange(3, 7)))
    return f"rev {word}={word[::-1]}"


def _sort(r: random.Random) -> str:
    digits = "".join(r.choice(string.digits) for _ in range(r.randrange(3, 7)))
    return f"sort {digits}={''.join(sorted(digits))}"


EASY_LINES: tuple[Callable[[random.Random], str], ...] = (_count, _alphabet, _echo, _sentence)
HARD_LINES: tuple[Callable[[random.Random], str], ...] = (_add, _reverse, _sort)


def generate_lines(n: int, *, seed: int, hard_fraction: float = 0.5) -> list[tuple[str, bool]]:
    """`n` lines as (text, is_hard), reproducible from `seed`."""
    if not 0.0 <= hard_fraction <= 1.0:
        raise ValueError(f"hard_fraction must be in [0, 1], got {hard_fraction}")
    r = random.Random(seed)
    lines = []
    for _ in range(n):
        hard = r.random() < hard_fraction
        lines.append((r.choice(HARD_LINES if hard else EASY_LINES)(r), hard))
    return lines


def build_tokenizer(texts: Sequence[str], *, vocab_size: int = 320) -> Any:
    """Byte-level BPE trained on `texts`, digits split one per token, as a transformers fast
    tokenizer (saved with the checkpoint, so the server encodes prompts the same way)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS,
                                   eos_token=EOS)


@dataclasses.dataclass(frozen=True)
class TokenStream:
    """A corpus as one token stream: ids [N] and each token's `TokenClass` [N]."""

    ids: torch.Tensor
    classes: torch.Tensor

    def __len__(self) -> int:
        return int(self.ids.numel())

    def windows(self, *, batch_size: int, seq_len: int, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_size` random windows of seq_len tokens (ids, classes), drawn from `generator`."""
        if len(self) < seq_len + 1:
            raise ValueError(f"corpus has {len(self)} tokens, fewer than seq_len + 1 "
                             f"({seq_len + 1})")
        starts = torch.randint(0, len(self) - seq_len, (batch_size,), generator=generator)
        index = starts.unsqueeze(1) + torch.arange(seq_len)
        return self.ids[index], self.classes[index]

    def chunks(self, *, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream cut into consecutive [n, seq_len] windows (the remainder is left out):
        every token scored once, for held-out evaluation."""
        n = len(self) // seq_len
        return (self.ids[:n * seq_len].view(n, seq_len),
                self.classes[:n * seq_len].view(n, seq_len))


def tokenize_lines(tokenizer: Any, lines: Sequence[tuple[str, bool]]) -> TokenStream:
    """Each line + newline, tokenized on its own and concatenated; hard lines are labelled
    prompt up to and including "=" and answer after it (by the tokens' character offsets)."""
    enc = tokenizer([text + "\n" for text, _ in lines], add_special_tokens=False,
                    return_offsets_mapping=True)
    ids: list[int] = []
    classes: list[int] = []
    for (text, hard), line_ids, offsets in zip(lines, enc["input_ids"],
                                               enc["offset_mapping"]):
        eq = text.find("=") if hard else -1
        for start, _ in offsets:
            if not hard:
                classes.append(TokenClass.EASY)
            else:
                classes.append(TokenClass.HARD_ANSWER if start > eq >= 0
                               else TokenClass.HARD_PROMPT)
        ids.extend(line_ids)
    return TokenStream(ids=torch.tensor(ids, dtype=torch.long),
                       classes=torch.tensor(classes, dtype=torch.long))


def tokenize_text(tokenizer: Any, text: str) -> TokenStream:
    """A plain text file's tokens (all labelled easy: no kinds are known)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return TokenStream(ids=torch.tensor(ids, dtype=torch.long),
                       classes=torch.zeros(len(ids), dtype=torch.long))
