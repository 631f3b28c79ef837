"""The policy: which numerics each GDN/KDA recurrence of a model gets.

    file_format.py       the policy file: its keys and values, parsed and validated (PolicyError), read and written
    quantizer_names.py   the quantizers a policy names, and which of them a quantizer_name glob can reach
    resolution.py        Policy: the rules matched to one module -> the spec fields of its recurrence; load_policy
    attach.py            attach_policy / policy_of: a policy that travels with the module and its checkpoints
    guard.py             PolicyGuardedGraph: a compiled graph that checks the running module's policy
    json_schema.py       the file's JSON Schema (policy.schema.json), generated from file_format's metadata
"""
