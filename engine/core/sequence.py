"""Per-request state: tokens, KV blocks, progress and output text."""

from enum import Enum, auto
from itertools import count

from engine.front.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request. Its KV history is its first `num_computed_tokens` tokens.

    With asynchronous scheduling the host learns a sampled token one step late: until then it is
    *pending*, counted in `len(seq)` (so the scheduler can plan the next step around it) but not
    yet in `token_ids`. Every pending token is the input of the sequence's next step, so
    `num_computed_tokens` may count it before `token_ids` holds it."""

    _ids = count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        max_model_len: int | None = None,
        priority: int = 0,
    ):
        self.seq_id = next(Sequence._ids)  # also the arrival order: ids only grow
        self.priority = priority  # vLLM's: lower is served first; see Scheduler
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        # One block table per KV-cache group (BlockManager): the blocks of its first len() * block_size positions.
        # A sliding-window group's entries that no query will see again are NO_BLOCK, their blocks released.
        self.block_tables: list[list[int]] = [[]]
        self.num_pending_tokens = 0  # sampled on the device, not yet read back by the host
        # The length at which the request finishes for "length": its token limit, or the context's.
        self.max_len = len(token_ids) + sampling_params.max_tokens
        if max_model_len is not None:
            self.max_len = min(self.max_len, max_model_len)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (or being written by a step in flight)
        self.num_cached_tokens = 0  # of those, how many the prefix cache served at admission
        self.num_registered_blocks = 0  # leading full blocks whose hash is registered
        self.registered_hash: int | None = None  # the chain hash of the last of them
        # Per group, (block_id, serial) of the registered block a lookup of those blocks ends on: the last of
        # them, or the block registered before with the same KV when this sequence computed a copy of it
        self.chain_tails: list[tuple[int, int] | None] = [None]
        self.num_released_blocks: list[int] = [0]  # per group, leading entries released (sliding windows)
        self.state_slot: int | None = None  # its recurrent layers' state slot while it runs (BlockManager)
        self.restore_slot: int | None = None  # a state snapshot its slot starts as, at admission on a cached prefix
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id it ended on (vLLM's)
        self.output_text = ""
        self.generator = None  # a torch.Generator when sampling_params.seed is set
        self.prefix_offset = self.read_offset = 0  # detokenizer window over the output tokens
        self.num_emitted_chars = 0  # how much of output_text the caller has been given
        self.stream_text = True  # detokenize every step; off when only the final text is wanted
        # Asked-for logprobs (SamplingParams.logprobs / prompt_logprobs), None when not asked. A prompt's
        # list starts with None: its first token has nothing before it to be predicted from.
        self.output_logprobs: list[dict[int, float]] | None = None if sampling_params.logprobs is None else []
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            None if sampling_params.prompt_logprobs is None else [None]
        )
        self.wants_logprobs = sampling_params.logprobs is not None or sampling_params.prompt_logprobs is not None
        # An llguidance matcher when sampling_params.structured_outputs is set: it has taken every output
        # token the host has read, and masks what may come next (engine/sample/structured_output.py)
        self.grammar = None
        # Speculative decoding (engine/spec_decode/): the tokens proposed for the next step to check after its input,
        # and how proposing goes for this request (a DraftState), while a speculative_config is set
        self.draft_token_ids: list[int] = []
        self.draft_state = None

    @property
    def block_table(self) -> list[int]:
        """The first group's block table: the only one of a model whose layers all attend alike."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def chain_tail(self) -> tuple[int, int] | None:
        return self.chain_tails[0]

    def __len__(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the host has read (pending ones not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens
