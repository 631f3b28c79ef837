"""The IR: the laqat ops a rewritten graph holds and the spec each node carries.

    spec.py               RecurrenceSpec: the printable, canonical string of a node's numerics
    delta_rule.py         laqat::delta_rule (and its train / eval / backward ops): the recurrence node
    delta_rule_phased.py  laqat::delta_rule_phased: the node under a decode phase
    log_decay.py          laqat::log_decay: the log of a decay passed in exponentiated
    checks.py             the input checks every op runs (IRInputError)
"""
