"""DeepSeek-V4.1-Flash text model built from layers: attention of every layer kind (SWA, C1, C2 with compressor,
indexer and cross-layer sharing, YOCO), mHC, Engram, MoE, DSpark drafter blocks, and the model that runs them over
the paged incremental state. Import ``DeepseekV41ForCausalLM`` from here.
"""

from deepinfer_model.deepseek_v41.engram import EngramVocab
from deepinfer_model.deepseek_v41.engram_vocab import engram_vocab_from_tokenizer
from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.deepseek_v41.moe import ExpertDispatch, local_expert_dispatch

__all__ = [
    "DeepseekV41ForCausalLM",
    "EngramVocab",
    "ExpertDispatch",
    "ExpertParallelMoE",
    "engram_vocab_from_tokenizer",
    "local_expert_dispatch",
]
