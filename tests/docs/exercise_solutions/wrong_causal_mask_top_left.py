"""Wrong: aligned to the top-left corner (query i sees keys 0..i)."""


def causal_mask(num_queries, num_keys):
    return [[j <= i for j in range(num_keys)] for i in range(num_queries)]
