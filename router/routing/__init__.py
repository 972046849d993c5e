"""Which worker gets a request: its inputs (tokens, block keys), the policy (filters,
scorers, picker, planner), prefix heat and session affinity. The cost model they price
workers with is the core's (:mod:`kvpool.cost`)."""
