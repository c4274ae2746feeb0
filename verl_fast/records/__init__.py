"""The step's records, below everything that produces or consumes them: the dataset's rows as prompts
and pairs (``prompts``), what a generation asks and returns (``generation``), one step's rollout as
training tensors (``experience``). They import nothing of verl_fast above them."""
