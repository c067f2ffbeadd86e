"""Wrong: bottom-right, but a query does not see its own key."""


def causal_mask(num_queries, num_keys):
    start = num_keys - num_queries
    return [[j < start + i for j in range(num_keys)]
            for i in range(num_queries)]
