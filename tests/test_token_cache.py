"""runtime/request/token_cache.py: a text that extends (or shares a prefix with) one tokenized recently
gets exactly the ids of tokenizing it whole, for the built-in tokenizer, a Llama-3-style regex split
and a byte-level BPE whose merges cross spaces (which the cache leaves whole); memory stays bounded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.request import token_cache
from radixlm.runtime.request.token_cache import PrefixTokenizer

# fragments that stress a regex split: contractions, runs of spaces and newlines, digits, punctuation,
# multi-byte characters, an added token, words that continue across the cut
FRAGMENTS = ["the", " the", "cat", "s", "'s", "'re", "'ll", " ", "  ", "   ", "\n", "\n\n", "\t", "1", "23", "456",
             ",", ".", "!?", "{\"a\": 1}", "é", "ü", "日本", "😀", "<|im_start|>", "<|im_end|>", "user", "\n ", "a'"]
TEXTS = st.lists(st.sampled_from(FRAGMENTS), min_size=0, max_size=120).map("".join)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(autouse=True)
def short_texts(monkeypatch):
    monkeypatch.setattr(token_cache, "MIN_CHARS", 0)  # every text goes through the cache here


def trained(pre_tokenizer) -> object:
    """A byte-level BPE trained here on a small corpus, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    corpus = ["the cat's   mat, 123 456 and the dog's bed!\n\n" * 20, "é ü 日本 😀 the the the cat cat"] * 10
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>",
                                                                                         "<|im_end|>"],
                                                         initial_alphabet=__import__("tokenizers").pre_tokenizers
                                                         .ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def tokenizers(tokenizer):
    from tokenizers import Regex, pre_tokenizers

    across_spaces = trained(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    llama3 = trained(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    return {"smollm2": tokenizer, "llama3-split": llama3, "merges-across-spaces": across_spaces}


def test_which_tokenizers_the_cache_applies_to(tokenizers):
    assert PrefixTokenizer(tokenizers["smollm2"]).enabled
    assert PrefixTokenizer(tokenizers["llama3-split"]).enabled
    assert not PrefixTokenizer(tokenizers["merges-across-spaces"]).enabled  # no split BPE stays inside


@pytest.mark.parametrize("name", ["smollm2", "llama3-split", "merges-across-spaces"])
@given(base=TEXTS, more=TEXTS, cut=st.integers(0, 10**6), other=TEXTS)
@settings(max_examples=examples(150), deadline=None)
def test_ids_equal_tokenizing_the_whole_text(tokenizers, name, base, more, cut, other):
    """A text, then the text extended, then a text that shares a prefix of it and parts: each the
    ids of tokenizing it whole (the whole of the second and third came partly from the cache)."""
    tok = tokenizers[name]
    cache = PrefixTokenizer(tok)
    extended = base + more
    diverged = extended[: cut % (len(extended) + 1)] + other
    for text in (base, extended, diverged, extended):
        assert cache.encode(text) == tok(text).input_ids, (name, text)


def test_a_long_history_reuses_its_ids_and_memory_stays_bounded(tokenizer):
    cache = PrefixTokenizer(tokenizer, max_entries=3, max_chars=200_000)
    turn = " The user asked about the weather in Paris; the tool said 21 degrees and sunny.\n"
    text = "<|im_start|>system\nYou are helpful.<|im_end|>\n"
    for i in range(40):
        text += turn.replace("Paris", f"city {i}")
        assert cache.encode(text) == tokenizer(text).input_ids
    assert cache.reused_tokens > 10 * cache.new_tokens, (cache.reused_tokens, cache.new_tokens)
    for i in range(6):  # unrelated texts: the least recently used go
        cache.encode(f"{i} unrelated " * 400)
    assert len(cache._entries) <= 3 and cache._chars <= 200_000


@pytest.mark.parametrize("name", ["smollm2", "llama3-split", "merges-across-spaces"])
@given(seen=st.lists(TEXTS, max_size=3), batch=st.lists(st.tuples(st.integers(0, 3), TEXTS), min_size=1,
                                                      max_size=6), head=TEXTS)
@settings(max_examples=examples(100), deadline=None)
def test_a_batch_gets_each_texts_whole_ids(tokenizers, name, seen, batch, head):
    """`encode_batch`: texts that share a head with each other or with texts seen before, or nothing;
    each the ids of tokenizing it whole, in order."""
    tok = tokenizers[name]
    cache = PrefixTokenizer(tok)
    for text in seen:
        cache.encode(head + text)
    texts = [(head if k else "") + (seen[k - 1] if 0 < k <= len(seen) else "") + tail for k, tail in batch]
    assert cache.encode_batch(texts) == [tok(t).input_ids for t in texts]


def test_a_few_shot_batch_tokenizes_the_shared_prefix_once(tokenizer):
    shared = "".join(f"Example {i}: the cat sat on mat number {i}, and 12 dogs barked.\n" for i in range(60))
    texts = [shared + f"Question {i}: where did cat {i} sit?" for i in range(16)]
    cache = PrefixTokenizer(tokenizer)
    assert cache.encode_batch(texts) == [tokenizer(t).input_ids for t in texts]
    assert cache.new_tokens < 2 * len(tokenizer(shared).input_ids), (cache.new_tokens, cache.reused_tokens)


def test_a_text_sent_again_is_not_tokenized_again(tokenizer):
    """A retried prompt (alone or twice in a batch) takes its entry's ids: no tokenizer call."""
    text = "".join(f"Turn {i}: the user asked about city {i}; the tool said 21 degrees.\n" for i in range(50))
    cache = PrefixTokenizer(tokenizer)
    whole = tokenizer(text).input_ids
    assert cache.encode(text) == whole
    new = cache.new_tokens
    assert cache.encode(text) == whole and cache.encode_batch([text, text]) == [whole, whole]
    assert cache.new_tokens == new
    cache.encode(text)[0] = -1  # the caller's list is its own
    assert cache.encode(text) == whole
