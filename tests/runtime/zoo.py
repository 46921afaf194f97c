"""A zoo of tiny, randomly initialised Hugging Face models for exactness tests.

Each `ZooCase` builds one architecture from a config written here (no downloads): 2-3 layers,
hidden size 64, vocab 128, every dropout the config family offers switched on (p = 0.1), the
attention implementation chosen explicitly, and a batch of token ids with labels. Tests run
`step` once without and once under an activation-memory plan from the same RNG state, and compare
the loss and every gradient bit for bit; dropout being on is what makes the RNG state matter.

The cases are meant to span the module structures such a manager has to cope with: pre/post norm,
parallel attention + MLP blocks, ALiBi and rotary position encodings, eager and SDPA attention,
one layer module called several times (ALBERT), encoder-decoder stacks with cross-attention,
mixture-of-experts blocks whose expert loop depends on the routing, and mixtures of experts whose
first layers are dense (Qwen2-MoE's mlp_only_layers, DeepSeek-V3's first_k_dense_replace).

Deliberate exceptions to "every dropout on": LayerDrop (OPT, BART, Pegasus) stays 0 because it
skips whole layers at random, so the set of ops changes from step to step and skipped layers get no
gradient; the MoE router jitter (Mixtral) stays 0 because it multiplies the MoE block's input in
place.

Things tests should know:
- `build(dtype)` seeds torch itself, so every call returns the same weights and batch.
- The batch never sets `use_cache`, so decoder-only models and T5 return a filled KV cache
  (`out.cache`) even in training; it holds every layer's keys and values.
- DeepSeek-V3's router keeps only the indices of its `topk`s and masks its scores: the autograd
  nodes that saved them die in forward (the profiler's tracer keeps them alive).
- Mixtral, OLMoE and the dense-first Qwen2-MoE compute their aux loss from router logits collected by forward hooks that
  transformers installs lazily on the first forward (on each decoder layer, its self_attn and its
  router); they stay installed afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers as hf

VOCAB = 128
BATCH = 2
SEQ = 16  # decoder-only and encoder-only inputs, and encoder-decoder sources
TARGET = 8  # encoder-decoder targets (labels); a different length than the source on purpose
POSITIONS = 64
P = 0.1  # every dropout probability
# Token ids are drawn from [1, VOCAB); 0 is the pad id everywhere, so no input token is padding.
PAD = 0

Batch = dict[str, torch.Tensor]
Built = tuple[torch.nn.Module, Batch]


@dataclass(frozen=True)
class ZooCase:
    name: str  # e.g. "gpt2-eager"
    family: str  # "decoder", "encoder", "encoder-decoder" or "moe"
    # any of "alibi", "parallel-attn", "eager", "sdpa", "shared-layers", "rotary", "moe", "cross-attention",
    # "dense-first" (a mixture of experts whose first layers are dense);
    # exactly one of "eager"/"sdpa", the attention implementation the model was built with
    traits: tuple[str, ...]
    build: Callable[[torch.dtype], Built]  # (model in train() mode, batch kwargs: tensors only)


def step(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """One training step's forward and backward; returns the loss (which includes any MoE aux loss)."""
    out = model(**batch)
    out.loss.backward()
    return out.loss


def _ids(length: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, length))


def _lm_batch() -> Batch:
    ids = _ids(SEQ)
    return {"input_ids": ids, "labels": ids.clone()}


def _seq2seq_batch() -> Batch:
    # The models derive decoder_input_ids from labels (shifted right, decoder start token first).
    return {"input_ids": _ids(SEQ), "labels": _ids(TARGET)}


def _build(model_cls: type[torch.nn.Module], config: hf.PretrainedConfig, dtype: torch.dtype,
           make_batch: Callable[[], Batch] = _lm_batch) -> Built:
    """Shared by every builder. The weights and then the batch come from one seeded RNG stream,
    so both are the same on every call; train() switches dropout on."""
    torch.manual_seed(0)
    model = model_cls(config).to(dtype).train()
    return model, make_batch()


# ---------------------------------------------------------------------------------------------
# Decoder-only
# ---------------------------------------------------------------------------------------------


def _gpt2_config(attn: str) -> hf.GPT2Config:
    return hf.GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=64, n_layer=3, n_head=4, n_inner=128,
        resid_pdrop=P, embd_pdrop=P, attn_pdrop=P, summary_first_dropout=P, summary_last_dropout=P,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation=attn,
    )


def build_gpt2_eager(dtype: torch.dtype) -> Built:
    return _build(hf.GPT2LMHeadModel, _gpt2_config("eager"), dtype)


def build_gpt2_sdpa(dtype: torch.dtype) -> Built:
    # Same model, attention (and its dropout) inside torch's scaled_dot_product_attention.
    return _build(hf.GPT2LMHeadModel, _gpt2_config("sdpa"), dtype)


def build_llama(dtype: torch.dtype) -> Built:
    # Grouped-query attention (4 query heads share 2 key/value heads); attention is Llama's only dropout.
    config = hf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=POSITIONS, attention_dropout=P,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation="sdpa",
    )
    return _build(hf.LlamaForCausalLM, config, dtype)


def build_qwen2(dtype: torch.dtype) -> Built:
    # Like Llama but with biased q/k/v projections; eager attention for contrast with Llama.
    config = hf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=POSITIONS, attention_dropout=P, use_sliding_window=False,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation="eager",
    )
    return _build(hf.Qwen2ForCausalLM, config, dtype)


def build_mistral(dtype: torch.dtype) -> Built:
    # A sliding window shorter than the sequence, so the mask is banded rather than plain causal.
    config = hf.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=POSITIONS, sliding_window=SEQ // 2, attention_dropout=P,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation="sdpa",
    )
    return _build(hf.MistralForCausalLM, config, dtype)


def build_opt(dtype: torch.dtype) -> Built:
    config = hf.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, word_embed_proj_dim=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=POSITIONS, dropout=P, attention_dropout=P,
        layerdrop=0.0,  # see the module docstring
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation="eager",
    )
    return _build(hf.OPTForCausalLM, config, dtype)


def build_gpt_neox(dtype: torch.dtype) -> Built:
    # Parallel residual: x + attn(ln1(x)) + mlp(ln2(x)); rotary on a quarter of each head.
    config = hf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=POSITIONS, use_parallel_residual=True,
        attention_dropout=P, hidden_dropout=P, classifier_dropout=P,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation="sdpa",
    )
    return _build(hf.GPTNeoXForCausalLM, config, dtype)


def _falcon_config(alibi: bool, attn: str) -> hf.FalconConfig:
    # Falcon-7B style block: one layer norm feeds attention and MLP in parallel, multi-query attention.
    return hf.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=128,
        max_position_embeddings=POSITIONS, parallel_attn=True, new_decoder_architecture=False, multi_query=True,
        alibi=alibi, hidden_dropout=P, attention_dropout=P, classifier_dropout=P,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation=attn,
    )


def build_falcon(dtype: torch.dtype) -> Built:
    # This block never uses attention_dropout (SDPA gets dropout_p=0, the parallel block skips the
    # post-attention dropout_add); its dropout is hidden_dropout on the block output.
    return _build(hf.FalconForCausalLM, _falcon_config(alibi=False, attn="sdpa"), dtype)


def build_falcon_alibi(dtype: torch.dtype) -> Built:
    # Eager: the ALiBi bias is added to the scores and attention dropout runs as a separate op
    # (Falcon's SDPA path would fold both into the kernel call).
    return _build(hf.FalconForCausalLM, _falcon_config(alibi=True, attn="eager"), dtype)


def build_bloom(dtype: torch.dtype) -> Built:
    # Bloom has eager attention only (ALiBi bias added through baddbmm).
    config = hf.BloomConfig(
        vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=P, attention_dropout=P,
        classifier_dropout=P, bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation="eager",
    )
    return _build(hf.BloomForCausalLM, config, dtype)


def build_phi(dtype: torch.dtype) -> Built:
    # Phi-2 block: attention and MLP both read the same layer norm output (parallel); partial rotary.
    config = hf.PhiConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=POSITIONS, resid_pdrop=P, embd_pdrop=P, attention_dropout=P,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation="sdpa",
    )
    return _build(hf.PhiForCausalLM, config, dtype)


def build_gptj(dtype: torch.dtype) -> Built:
    # GPT-J block: parallel attention + MLP on one layer norm; rotary on the first rotary_dim channels.
    config = hf.GPTJConfig(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=128,
        resid_pdrop=P, embd_pdrop=P, attn_pdrop=P,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation="eager",
    )
    return _build(hf.GPTJForCausalLM, config, dtype)


# ---------------------------------------------------------------------------------------------
# Encoder-only (masked LM heads)
# ---------------------------------------------------------------------------------------------


def build_bert(dtype: torch.dtype) -> Built:
    config = hf.BertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=POSITIONS, hidden_dropout_prob=P, attention_probs_dropout_prob=P,
        classifier_dropout=P, pad_token_id=PAD, attn_implementation="eager",
    )
    return _build(hf.BertForMaskedLM, config, dtype)  # MLM on every position: labels = inputs


def build_roberta(dtype: torch.dtype) -> Built:
    # Position ids are derived from the input ids (offset past the pad id), unlike BERT.
    config = hf.RobertaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=POSITIONS + 2, hidden_dropout_prob=P, attention_probs_dropout_prob=P,
        classifier_dropout=P, pad_token_id=PAD, bos_token_id=PAD, eos_token_id=PAD, attn_implementation="sdpa",
    )
    return _build(hf.RobertaForMaskedLM, config, dtype)  # MLM on every position: labels = inputs


def build_electra(dtype: torch.dtype) -> Built:
    # Embeddings narrower than the hidden size, with a projection in between.
    config = hf.ElectraConfig(
        vocab_size=VOCAB, embedding_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=POSITIONS, hidden_dropout_prob=P,
        attention_probs_dropout_prob=P, classifier_dropout=P, summary_last_dropout=P, pad_token_id=PAD,
        attn_implementation="eager",
    )
    return _build(hf.ElectraForMaskedLM, config, dtype)  # MLM on every position: labels = inputs


def build_albert(dtype: torch.dtype) -> Built:
    # One layer (one group of one layer) applied num_hidden_layers = 3 times: shared weights.
    config = hf.AlbertConfig(
        vocab_size=VOCAB, embedding_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_hidden_groups=1, inner_group_num=1, num_attention_heads=4, max_position_embeddings=POSITIONS,
        hidden_dropout_prob=P, attention_probs_dropout_prob=P, classifier_dropout_prob=P,
        pad_token_id=PAD, bos_token_id=PAD, eos_token_id=PAD, attn_implementation="sdpa",
    )
    return _build(hf.AlbertForMaskedLM, config, dtype)  # MLM on every position: labels = inputs


def build_distilbert(dtype: torch.dtype) -> Built:
    config = hf.DistilBertConfig(
        vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=POSITIONS,
        dropout=P, attention_dropout=P, qa_dropout=P, seq_classif_dropout=P, pad_token_id=PAD,
        attn_implementation="eager",
    )
    return _build(hf.DistilBertForMaskedLM, config, dtype)  # MLM on every position: labels = inputs


# ---------------------------------------------------------------------------------------------
# Encoder-decoder (conditional generation heads)
# ---------------------------------------------------------------------------------------------


def build_t5(dtype: torch.dtype) -> Built:
    # Relative position bias computed by the first block and passed down the stack.
    config = hf.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=POSITIONS, dropout_rate=P,
        classifier_dropout=P, pad_token_id=PAD, eos_token_id=1, decoder_start_token_id=PAD,
        attn_implementation="eager",
    )
    return _build(hf.T5ForConditionalGeneration, config, dtype, _seq2seq_batch)


def build_bart(dtype: torch.dtype) -> Built:
    config = hf.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=POSITIONS,
        dropout=P, attention_dropout=P, activation_dropout=P, classifier_dropout=P,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0,  # see the module docstring
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2,
        attn_implementation="sdpa",
    )
    return _build(hf.BartForConditionalGeneration, config, dtype, _seq2seq_batch)


def build_pegasus(dtype: torch.dtype) -> Built:
    # Pre-norm BART relative with fixed sinusoidal positions (a frozen parameter).
    config = hf.PegasusConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=POSITIONS,
        dropout=P, attention_dropout=P, activation_dropout=P,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0,  # see the module docstring
        pad_token_id=PAD, eos_token_id=1, decoder_start_token_id=PAD, forced_eos_token_id=1,
        attn_implementation="eager",
    )
    return _build(hf.PegasusForConditionalGeneration, config, dtype, _seq2seq_batch)


# ---------------------------------------------------------------------------------------------
# Mixture of experts: 4 experts, top-2 routing, the experts run as a Python loop over the experts
# that received tokens (experts_implementation="eager", not the grouped-matmul kernel).
# ---------------------------------------------------------------------------------------------


def build_mixtral(dtype: torch.dtype) -> Built:
    # The load-balancing aux loss is on (output_router_logits), so the loss depends on every router.
    config = hf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=POSITIONS, attention_dropout=P,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
        router_jitter_noise=0.0,  # see the module docstring
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
        attn_implementation="sdpa", experts_implementation="eager",
    )
    return _build(hf.MixtralForCausalLM, config, dtype)


def build_qwen2_moe(dtype: torch.dtype) -> Built:
    # Routed experts plus an always-on shared expert behind a sigmoid gate; no aux loss (plain LM loss),
    # for contrast with the other two MoE cases.
    config = hf.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=POSITIONS, attention_dropout=P, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, output_router_logits=False, use_sliding_window=False,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
        attn_implementation="eager", experts_implementation="eager",
    )
    return _build(hf.Qwen2MoeForCausalLM, config, dtype)


def build_olmoe(dtype: torch.dtype) -> Built:
    # RMS norms on q and k before rotary; aux loss on.
    config = hf.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=POSITIONS, attention_dropout=P,
        num_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
        attn_implementation="sdpa", experts_implementation="eager",
    )
    return _build(hf.OlmoeForCausalLM, config, dtype)


def build_qwen2_moe_dense_first(dtype: torch.dtype) -> Built:
    # The first layer's MLP is dense (mlp_only_layers), the later ones sparse: one block stack whose
    # layers differ in structure; aux loss on.
    config = hf.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=POSITIONS, attention_dropout=P, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[0], output_router_logits=True, router_aux_loss_coef=0.01,
        use_sliding_window=False, bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
        attn_implementation="eager", experts_implementation="eager",
    )
    return _build(hf.Qwen2MoeForCausalLM, config, dtype)


def build_deepseek_v3(dtype: torch.dtype) -> Built:
    # DeepSeek-V3 style: the first layer dense (first_k_dense_replace), then routed experts with a
    # shared expert; multi-head latent attention (low-rank q and kv); a sigmoid router that keeps
    # only topk's indices and masks its scores by group, so autograd lets go of what those nodes
    # saved while forward still runs (issue 19).
    config = hf.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=POSITIONS, attention_dropout=P,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
        attn_implementation="eager", experts_implementation="eager",
    )
    return _build(hf.DeepseekV3ForCausalLM, config, dtype)


_CASES = [
    ZooCase("gpt2-eager", "decoder", ("eager",), build_gpt2_eager),
    ZooCase("gpt2-sdpa", "decoder", ("sdpa",), build_gpt2_sdpa),
    ZooCase("llama", "decoder", ("sdpa", "rotary"), build_llama),
    ZooCase("qwen2", "decoder", ("eager", "rotary"), build_qwen2),
    ZooCase("mistral", "decoder", ("sdpa", "rotary"), build_mistral),
    ZooCase("opt", "decoder", ("eager",), build_opt),
    ZooCase("gpt-neox", "decoder", ("sdpa", "rotary", "parallel-attn"), build_gpt_neox),
    ZooCase("falcon", "decoder", ("sdpa", "rotary", "parallel-attn"), build_falcon),
    ZooCase("falcon-alibi", "decoder", ("eager", "alibi", "parallel-attn"), build_falcon_alibi),
    ZooCase("bloom", "decoder", ("eager", "alibi"), build_bloom),
    ZooCase("phi", "decoder", ("sdpa", "rotary", "parallel-attn"), build_phi),
    ZooCase("gptj", "decoder", ("eager", "rotary", "parallel-attn"), build_gptj),
    ZooCase("bert", "encoder", ("eager",), build_bert),
    ZooCase("roberta", "encoder", ("sdpa",), build_roberta),
    ZooCase("electra", "encoder", ("eager",), build_electra),
    ZooCase("albert", "encoder", ("sdpa", "shared-layers"), build_albert),
    ZooCase("distilbert", "encoder", ("eager",), build_distilbert),
    ZooCase("t5", "encoder-decoder", ("eager", "cross-attention"), build_t5),
    ZooCase("bart", "encoder-decoder", ("sdpa", "cross-attention"), build_bart),
    ZooCase("pegasus", "encoder-decoder", ("eager", "cross-attention"), build_pegasus),
    ZooCase("mixtral", "moe", ("sdpa", "rotary", "moe"), build_mixtral),
    ZooCase("qwen2-moe", "moe", ("eager", "rotary", "moe"), build_qwen2_moe),
    ZooCase("olmoe", "moe", ("sdpa", "rotary", "moe"), build_olmoe),
    ZooCase("qwen2-moe-dense-first", "moe", ("eager", "rotary", "moe", "dense-first"), build_qwen2_moe_dense_first),
    ZooCase("deepseek-v3", "moe", ("eager", "rotary", "moe", "dense-first"), build_deepseek_v3),
]

ZOO: dict[str, ZooCase] = {case.name: case for case in _CASES}
