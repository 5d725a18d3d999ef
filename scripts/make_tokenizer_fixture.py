#!/usr/bin/env python3
"""Train the small byte-level BPE `fixtures/tokenizer/tokenizer.json` (384 ids) on the bundled corpus.

Used by the tests of `--tokenizer`; needs the `tokenizers` Python package (comes with transformers).
"""
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=384, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train(["disagmoe-train/data/kjv-genesis-leviticus.txt"], trainer)
tok.save("fixtures/tokenizer/tokenizer.json")
print(tok.get_vocab_size())
