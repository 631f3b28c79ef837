"""What the backend does with a rewritten graph, and the wrappers around what it returns.

    compiler_choice.py           Inductor or eager: the choice and the call
    cache_key.py                 laqat's sources and policy in the keys of Inductor's and AOTAutograd's caches
    module_specialized_graph.py  one compiled version per set of modules a Dynamo graph serves
    ddp_buckets.py               a recurrence must lie in one of DDPOptimizer's pieces
    options_doc_section.py       the "Hand-off" section of docs/options.md
"""
