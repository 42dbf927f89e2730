"""HuggingFace transformers models on megakernels' fused kernels, in one call (docs/integrations.md).

    import megakernels.integrations.transformers as mkt

    model = LlamaForCausalLM(config)
    mkt.apply(model)                          # patch a built model in place

    with mkt.patch_llama():                   # or patch the family's classes: every model built inside is patched
        model = AutoModelForCausalLM.from_pretrained(path)

What changes (each switchable): LayerNorm / RMSNorm (and Qwen 3's per-head q/k RMSNorms) -> the fused norms; the MLP's
bias + GeLU -> fused bias-GeLU (GPT-2, BERT), gate/up + SiLU -> one GEMM and fused SwiGLU (Llama, Mistral, Qwen 2/2.5/3,
DeepSeek-V3's dense and shared-expert MLPs; Gemma 3's tanh-GeLU gate -> GeGLU); Mixtral's, Qwen 3 MoE's, gpt-oss's and
DeepSeek-V3's routed experts -> two grouped GEMMs around SwiGLU (gpt-oss's clamped one, with its biases), without a
data-dependent shape (``torch.compile(fullgraph=True)`` holds); a table tied between the input embedding and the LM head
-> its lookup's gradient added into the head's weight gradient (``megakernels.nn.TiedEmbedding``); attention ->
FlashAttention, a sliding window and gpt-oss's sinks inside the kernel, DeepSeek-V3's latent attention with its value
head dim apart from the query's and its YaRN-scaled softmax scale, under transformers' default name ``"sdpa"`` (also
registered as ``attn_implementation="megakernels"``, which a gpt-oss model, whose default in transformers is
``"eager"``, is switched to); the causal-LM loss -> the fused cross-entropy on the logits in their own dtype.
Parameters, their names and the state dict stay as they are, so checkpoints load and save either way.

What the patch never does: read the weight of a module it does not own (a linear wrapped by PEFT, quantised,
parametrized or hooked, also after the patch, is called: the fused MLP runs transformers' forward), override an
attention or experts implementation the caller chose, or hide a forward's signature. None of the families has a
norm followed by a GeLU, so the norms' GeLU epilogue has no use here.

transformers is an optional dependency: importing this module does not import it; the first call does, and checks
its version (``MIN_TRANSFORMERS_VERSION``).
"""

from __future__ import annotations

import functools
import warnings

from megakernels.integrations.transformers import _dispatch, _forwards
from megakernels.integrations.transformers._families import FAMILIES, bind, family_of, mark, patch_modules

MIN_TRANSFORMERS_VERSION = "5.0.0"  # 3-D Mixtral expert banks, AttentionMaskInterface, ``cache`` keyword
ATTN_IMPLEMENTATION = _forwards.NAME

__all__ = [
    "apply",
    "patch_classes",
    "require_transformers",
    "patch_gpt2",
    "patch_bert",
    "patch_llama",
    "patch_mistral",
    "patch_mixtral",
    "patch_qwen2",
    "patch_qwen3",
    "patch_qwen3_moe",
    "patch_gemma3",
    "patch_gpt_oss",
    "patch_deepseek_v3",
    "patch_deepseek_v2",
    "register",
    "supported_model_types",
    "ClassPatch",
    "MIN_TRANSFORMERS_VERSION",
    "ATTN_IMPLEMENTATION",
]


def require_transformers(op: str):
    """transformers, imported and version-checked (``op`` names the caller in the message).

    Raises:
        ImportError: transformers is not installed, or older than ``MIN_TRANSFORMERS_VERSION``.
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            f"{op}: needs HuggingFace transformers >= {MIN_TRANSFORMERS_VERSION} (pip install 'megakernels[hf]')"
        ) from e
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS_VERSION):
        raise ImportError(
            f"{op}: transformers {transformers.__version__} is installed; megakernels needs "
            f">= {MIN_TRANSFORMERS_VERSION}"
        )
    return transformers


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values :func:`apply` and :func:`patch_classes` accept."""
    return sorted(FAMILIES)


def register() -> None:
    """Register ``attn_implementation="megakernels"`` with transformers' ``AttentionInterface`` and its mask
    function (transformers' SDPA masks: None when no mask is needed, which is when FlashAttention runs; a sliding
    window alone needs none, the kernel applies it) with ``AttentionMaskInterface``. Idempotent; :func:`apply`
    calls it. After it, ``from_pretrained(..., attn_implementation="megakernels")`` works for any model using
    transformers' attention interface.

    Raises:
        ImportError: transformers missing or too old.
    """
    require_transformers("register")
    _forwards.register()


def _uses_causal_lm_loss(model) -> bool:
    """The model computes its loss through ``loss_function`` with transformers' causal-LM loss (``*ForCausalLM``;
    GPT-2's and BERT's LM-head models, whose class names map to no loss type, fall back to it)."""
    from transformers import GenerationMixin

    loss_type = getattr(model, "loss_type", None)
    return loss_type == "ForCausalLM" or (loss_type is None and isinstance(model, GenerationMixin))


def _takes_fused_head(model, family) -> bool:
    """A causal LM of a family whose ``*ForCausalLM`` is ``self.<body>`` then ``self.lm_head`` (not a model with
    heads of other kinds beside it, such as GPT-2's double-heads model)."""
    return (
        family.fused_head
        and type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
        and _uses_causal_lm_loss(model)
        and hasattr(model, "lm_head")
        and hasattr(model, family.body)
    )


def _patch_tied_embeddings(model, family) -> bool:
    """Bind the input embedding and the LM head of a model whose two share one table (no bias, no max_norm, no
    per-frequency scaling, dense gradients) to one ``TiedEmbedding``; False where the model has no such pair."""
    import torch

    from megakernels.nn.tied_embedding import TiedEmbedding

    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    # the exact classes: a subclass's forward computes something else (but the family's scaled lookups, known)
    scaled = type(inp) in family.classes(family.scaled_embeddings)
    if not (type(inp) is torch.nn.Embedding or scaled) or type(out) is not torch.nn.Linear:
        return False
    if out.weight is not inp.weight:
        return False
    if out.bias is not None or inp.max_norm is not None or inp.scale_grad_by_freq or inp.sparse:
        return False
    table = TiedEmbedding(inp.weight)
    bind(inp, _forwards.tied_lookup_forward, table=table, scaled=scaled)
    bind(out, _forwards.tied_logits_forward, table=table)
    return True


def apply(
    model,
    *,
    norms: bool = True,
    mlp: bool = True,
    attention: bool = True,
    loss: bool = True,
    fused_head: bool = False,
    tied_embeddings: bool = True,
    linears: bool = True,
) -> dict:
    """Patch a built transformers model in place to run on megakernels' fused kernels.

    Args:
        model: a ``transformers.PreTrainedModel`` of a supported ``config.model_type`` (gpt2, bert, llama,
            mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma3_text, gpt_oss, deepseek_v3, deepseek_v2), on any
            device and dtype, built or loaded already; or a PEFT
            ``PeftModel``, whose base model is patched (before or after ``get_peft_model``: the adapters' layers
            are always called).
        norms: LayerNorm / RMSNorm modules -> ``megakernels.ops.layer_norm`` / ``rms_norm``.
        mlp: the MLP activation -> ``bias_gelu`` (GeLU MLPs) or one GEMM + ``swiglu`` (gated MLPs), on each call
            where the linears it reads are plain ``nn.Linear`` / ``Conv1D`` (PEFT, quantised or hooked linears:
            transformers' forward, which calls them); Mixtral's, Qwen 3 MoE's, gpt-oss's and DeepSeek-V3's
            experts -> ``grouped_gemm``
            where their experts implementation is transformers' default (``"grouped_mm"``) or
            ``"megakernels"``; their top-k routers -> ``megakernels.ops.moe_router`` (fp32 routing in one pass).
            A model whose activation is neither a GeLU nor SiLU keeps its MLP.
        attention: where the caller chose no attention implementation (transformers' default ``"sdpa"``, which
            the config keeps saying), the attention runs FlashAttention without a mask and transformers' SDPA
            where a mask is needed; an implementation the caller chose (``attn_implementation=`` or the config;
            known for models built under :func:`patch_classes`, otherwise any but ``"sdpa"``) is kept. gpt-oss,
            which transformers runs ``"eager"`` by default (it has no SDPA path), is switched to ``"megakernels"``
            (its sinks in the kernel; the eager attention where a mask is needed). A config with attention-logit
            soft-capping (``attn_logit_softcapping``) keeps its attention, named in ``declined``.
        loss: the causal-LM loss (``model.loss_function``) -> ``megakernels.ops.cross_entropy`` on the logits in
            their own dtype; only models using transformers' causal-LM loss are changed.
        fused_head: in training mode with labels, the LM head and its loss as one
            ``megakernels.ops.linear_cross_entropy`` (chunks of tokens: the ``[tokens, vocab]`` logits exist only if
            ``out.logits`` is read, which computes them then); the causal LMs of gpt2, llama, mistral, qwen2, qwen3,
            gemma3_text (its ``final_logit_softcapping`` inside the fused loss), gpt_oss (a call asking for router
            logits runs the class's forward), deepseek_v3 and deepseek_v2. Off by default (code that reads the
            training logits pays for the head twice).
        tied_embeddings: where the input embedding and the LM head share one table (GPT-2; models with
            ``tie_word_embeddings``), the lookup's gradient is added into the head's weight gradient row by row
            instead of through a dense ``[vocab, hidden]`` table (``megakernels.nn.TiedEmbedding``; the same
            gradient up to the order of fp32 sums; also into the fused head's, ``fused_head``).
        linears: every ``nn.Linear`` and transformers ``Conv1D`` (the projections; also the patched MLPs' GEMMs)
            -> ``megakernels.ops.gemm.linear``: fp32 products on the CPU through oneDNN's GEMM where it was
            measured faster than ``F.linear`` on this machine (``gemm.route()``); ``F.linear`` itself elsewhere.

    Returns:
        What was patched: ``{"norms": int, "mlp": int, "routers": int, "experts": int, "linears": int,
        "attention": bool, "loss": bool, "fused_head": bool, "tied_embeddings": bool, "declined": list[str]}``;
        ``declined`` names the modules that keep transformers' forward because what the fused one reads is wrapped
        or replaced, or (with the reason in parentheses) that the fused one does not compute what the config asks
        (one warning names them too).

    Raises:
        ImportError: transformers missing or older than ``MIN_TRANSFORMERS_VERSION``. TypeError: ``model`` is not
        a transformers ``PreTrainedModel``. ValueError: a model type the integration does not know (named), or
        ``fused_head`` for a model without such a head (a family or class other than those above).
    """
    op = "megakernels.integrations.transformers.apply"
    transformers = require_transformers(op)
    model = _base_model(model)
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"{op}: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    family = family_of(getattr(model.config, "model_type", None), op)
    register()
    done = patch_modules(model, family, norms=norms, mlp=mlp, linears=linears)
    declined = done.pop("declined")
    done["experts"] = 0
    if mlp and family.experts:
        impl = getattr(model.config, "_experts_implementation", None)
        if impl == _forwards.NAME or _dispatch.chosen_by_default(model.config, _dispatch.EXPERTS):
            done["experts"] = mark(model, family, _dispatch.EXPERTS)
    done["attention"] = False
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    if attention and softcap is not None:
        declined.append(f"attention (attn_logit_softcapping={softcap}: FlashAttention has no logit soft-capping)")
    elif attention:
        impl = model.config._attn_implementation
        if impl == _forwards.NAME:
            done["attention"] = True
        elif _dispatch.chosen_by_default(model.config, _dispatch.ATTENTION, family.attention_default):
            if family.attention_default != _dispatch.DEFAULT[_dispatch.ATTENTION]:
                model.set_attn_implementation(_forwards.NAME)
            else:
                mark(model, family, _dispatch.ATTENTION)
                _dispatch.accelerate(model.config, _dispatch.ATTENTION)
            done["attention"] = True
    done["loss"] = bool(loss) and _uses_causal_lm_loss(model)
    if done["loss"]:
        model.loss_function = _forwards.causal_lm_loss
    done["fused_head"] = False
    if fused_head:
        if not _takes_fused_head(model, family):
            raise ValueError(
                f"{op}: fused_head is for the causal LMs of "
                f"{', '.join(sorted(k for k, f in FAMILIES.items() if f.fused_head))}; got a {type(model).__name__}"
            )
        own = model.__dict__.get("forward")
        if getattr(own, "megakernels_trl", False):  # megakernels' head under TRL's (integrations.trl): kept
            done["fused_head"] = True
        elif own is not None and getattr(own, "func", None) is not _forwards.fused_head_forward:
            name = getattr(own, "__qualname__", None) or getattr(getattr(own, "func", None), "__qualname__", own)
            declined.append(f"{type(model).__name__}.forward (replaced by {name})")
        else:
            bind(model, _forwards.fused_head_forward, _body=family.body)
            done["fused_head"] = _forwards.head_fuses(model)
            if not done["fused_head"]:
                declined.append(f"{type(model).__name__}'s LM head or loss")
    done["tied_embeddings"] = bool(tied_embeddings) and _patch_tied_embeddings(model, family)
    done["declined"] = declined
    if declined:
        shown = ", ".join(declined[:4]) + (f" and {len(declined) - 4} more" if len(declined) > 4 else "")
        warnings.warn(
            f"{op}: {len(declined)} module(s) keep transformers' forward, since what the fused one reads is wrapped "
            f"(PEFT, quantised, hooked) or replaced, or it does not compute what the config asks (as noted): {shown}",
            stacklevel=2,
        )
    return done


def _base_model(model):
    """The transformers model a PEFT ``PeftModel`` wraps (``get_base_model()``); any other object as it is."""
    get = getattr(model, "get_base_model", None)
    if callable(get) and type(model).__module__.split(".")[0] == "peft":
        return get()
    return model


class ClassPatch:
    """Class patching of one model family: every model of the family built while it is active is patched by
    :func:`apply` with the same options as the last step of its construction (``post_init``), whether built from a
    config or by ``from_pretrained`` (which then loads without the `kernels` hub's kernelization unless given
    ``use_kernels=True``: it would unbind the fused norms). Its ``__init__`` notes which attention and experts
    implementations the caller asked for before transformers resolves them (``attn_implementation=`` of
    ``from_pretrained`` / ``from_config``, or set on the config), so that :func:`apply` keeps those. ``revert()``
    (or leaving the ``with`` block) restores the classes; models built meanwhile stay patched."""

    _active: dict[str, ClassPatch] = {}

    def __init__(self, model_type: str, options: dict):
        self.model_type, self.options = model_type, options
        self._base = base = getattr(FAMILIES[model_type].modeling, FAMILIES[model_type].base)
        names = ("__init__", "post_init", "from_pretrained", "_from_config")
        self._own = {name: base.__dict__.get(name) for name in names}
        inherited = {name: getattr(super(base, base), name) for name in names}
        init_, post_init_, load_, from_config_ = (self._own[n] or inherited[n] for n in names)

        @functools.wraps(init_)
        def __init__(model, config, *args, **kwargs):
            before = _dispatch.requested(config)
            init_(model, config, *args, **kwargs)
            _dispatch.note_request(config, before, FAMILIES[model_type].attention_default)

        @functools.wraps(post_init_)
        def post_init(model):
            post_init_(model)
            if getattr(model.config, "model_type", None) != model_type:
                return  # a class of the base serving another model type (Gemma 3's multimodal model: its text model)
            # the fused head is for the family's causal LM; its other classes (the bare model, classifiers) skip it
            fused = options.get("fused_head", False) and _takes_fused_head(model, FAMILIES[model_type])
            apply(model, **{**options, "fused_head": fused})

        # from_pretrained kernelizes the loaded model with the `kernels` hub by default (transformers >= 5.2x), which
        # drops the forwards post_init bound on the layers it maps (the RMSNorms): off unless asked for.
        load, build = load_.__func__, from_config_.__func__

        @functools.wraps(load)
        def from_pretrained(cls, *args, **kwargs):
            kwargs.setdefault("use_kernels", False)
            with _dispatch.asked(kwargs):
                return load(cls, *args, **kwargs)

        @functools.wraps(build)
        def _from_config(cls, config, **kwargs):
            with _dispatch.asked(kwargs):
                return build(cls, config, **kwargs)

        register()
        base.__init__, base.post_init = __init__, post_init
        base.from_pretrained, base._from_config = classmethod(from_pretrained), classmethod(_from_config)
        ClassPatch._active[model_type] = self

    @property
    def active(self) -> bool:
        return ClassPatch._active.get(self.model_type) is self

    def revert(self) -> None:
        """Restore the family's classes (idempotent)."""
        if not self.active:
            return
        for name, own in self._own.items():
            if own is None:
                delattr(self._base, name)
            else:
                setattr(self._base, name, own)
        del ClassPatch._active[self.model_type]

    def __enter__(self) -> ClassPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def patch_classes(
    model_type: str,
    *,
    norms: bool = True,
    mlp: bool = True,
    attention: bool = True,
    loss: bool = True,
    fused_head: bool = False,
    tied_embeddings: bool = True,
    linears: bool = True,
) -> ClassPatch:
    """Patch the classes of ``model_type``'s family so every model of it built afterwards is patched (see
    :class:`ClassPatch`; the options are :func:`apply`'s).

    Returns:
        The active :class:`ClassPatch` (a context manager; ``revert()`` undoes it).

    Raises:
        ImportError: transformers missing or too old. ValueError: an unknown model type (named), or a family that
        is class-patched already (revert that patch first).
    """
    op = "megakernels.integrations.transformers.patch_classes"
    require_transformers(op)
    family_of(model_type, op)
    if model_type in ClassPatch._active:
        raise ValueError(f"{op}: the {model_type!r} classes are patched already; revert() that patch first")
    options = {
        "norms": norms,
        "mlp": mlp,
        "attention": attention,
        "loss": loss,
        "fused_head": fused_head,
        "tied_embeddings": tied_embeddings,
        "linears": linears,
    }
    return ClassPatch(model_type, options)


def patch_gpt2(**options) -> ClassPatch:
    """:func:`patch_classes` for GPT-2 (fused LayerNorm, bias-GeLU MLP, FlashAttention, fused loss)."""
    return patch_classes("gpt2", **options)


def patch_bert(**options) -> ClassPatch:
    """:func:`patch_classes` for BERT (fused LayerNorm, bias-GeLU intermediate and LM-head transform,
    FlashAttention, fused loss of ``BertLMHeadModel``)."""
    return patch_classes("bert", **options)


def patch_llama(**options) -> ClassPatch:
    """:func:`patch_classes` for Llama (fused RMSNorm, SwiGLU MLP, FlashAttention, fused loss)."""
    return patch_classes("llama", **options)


def patch_mistral(**options) -> ClassPatch:
    """:func:`patch_classes` for Mistral (as Llama; the sliding window inside FlashAttention)."""
    return patch_classes("mistral", **options)


def patch_mixtral(**options) -> ClassPatch:
    """:func:`patch_classes` for Mixtral (fused RMSNorm, grouped-GEMM experts, FlashAttention, fused loss)."""
    return patch_classes("mixtral", **options)


def patch_qwen2(**options) -> ClassPatch:
    """:func:`patch_classes` for Qwen 2 / 2.5 (as Llama; the q/k/v biases stay in their projections)."""
    return patch_classes("qwen2", **options)


def patch_qwen3(**options) -> ClassPatch:
    """:func:`patch_classes` for Qwen 3 (as Llama, with the per-head q/k RMSNorms fused too)."""
    return patch_classes("qwen3", **options)


def patch_qwen3_moe(**options) -> ClassPatch:
    """:func:`patch_classes` for Qwen 3 MoE (fused RMSNorms, grouped-GEMM experts, FlashAttention, fused loss)."""
    return patch_classes("qwen3_moe", **options)


def patch_gemma3(**options) -> ClassPatch:
    """:func:`patch_classes` for Gemma 3's text model (``gemma3_text``: fused ``1 + weight`` RMSNorms, q/k norms
    included, GeGLU MLP, FlashAttention with each layer's sliding window, fused loss)."""
    return patch_classes("gemma3_text", **options)


def patch_gpt_oss(**options) -> ClassPatch:
    """:func:`patch_classes` for gpt-oss (fused RMSNorms, grouped-GEMM experts with the clamped SwiGLU and biases,
    FlashAttention with the sinks and each layer's window, fused loss)."""
    return patch_classes("gpt_oss", **options)


def patch_deepseek_v3(**options) -> ClassPatch:
    """:func:`patch_classes` for DeepSeek-V3 (fused RMSNorms, the latents' included; SwiGLU dense and shared-expert
    MLPs; grouped-GEMM routed experts, the router through ``moe_router``; FlashAttention with the value head dim
    apart from the query's and the module's YaRN-scaled softmax scale; fused loss)."""
    return patch_classes("deepseek_v3", **options)


def patch_deepseek_v2(**options) -> ClassPatch:
    """:func:`patch_classes` for DeepSeek-V2 (as :func:`patch_deepseek_v3`, with V2's softmax router through
    ``moe_router``: greedy top-k, the weights scaled and not renormalised)."""
    return patch_classes("deepseek_v2", **options)
