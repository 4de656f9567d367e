"""One continuation of a prompt after its prefill: sampling parameters and token selection, what they
do to the logits (penalties, bias, structured-output grammars), the sequence that carries them token
by token, and incremental detokenization."""
