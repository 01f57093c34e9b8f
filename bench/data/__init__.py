"""`python -m bench.data`: data preparation and streaming-loader throughput (see bench/data/main.py).

    main        the driver: makes the corpus, runs each measurement, prints the table, writes the docs
    prepare     `undying data prepare` on Ray Data against one-process `tokenizers` loops
    loader      the streaming loader's windows per second per rank, file:// and s3://, and the data wait
                of a training loop
"""
