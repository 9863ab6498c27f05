"""The stages of a shrink, each a function of typed values, in the order a run takes them:

- `read`: the input model (a `Source`) and the masks given (`GivenMasks`), checked;
- `masking.bind`: the masks bound to the model's weights, and the reference they make (`Masked`);
- `attempt.first_attempt`: analyze, rewrite and prove (a `proof.recover.Attempt`);
- `recovery.recovered`: from a failed proof, the removals responsible kept back (a `Run`);
- `assemble.assemble`: the `ShrinkResult` of the run;
- `save`: the result written, the runtimes' configs beside it, and its verdict (`finished`).

`api.shrink` composes them from a file or a ModelProto and masks; `prune.run.prune` from the
reference it builds (the input with the chosen groups zeroed).
"""
