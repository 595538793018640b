"""What a request reports: ``finish.py`` decides after each token whether it is done (EOS, stop
ids, stop strings, bounded stop regexes, length); ``detokenizer.py`` turns ids into text
incrementally (stop strings trimmed, multi-byte characters kept whole); ``accumulator.py`` holds
the StepOutput a step reports and the one accumulator (RequestOutput) that turns them into
SGLang-shaped results for the Engine and the server."""
