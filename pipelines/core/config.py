"""Moved: the params schemas are `pipelines.core.params` (one module per family of stages), the
plain-data helpers `to_plain`, `flatten` and `digest` are in `pipelines.core.outputs`, and the
loading of users' reward and tool functions in `pipelines.core.extensions`. This module re-exports
every name it had, for plug-ins written against it, and warns; it goes in the next release."""

from __future__ import annotations

import warnings

from pipelines.core.extensions import BUILT_IN_REWARDS, BUILT_IN_TOOLS, REWARD_ARGUMENTS, user_reward, user_tool  # noqa: F401
from pipelines.core.outputs import digest, flatten, to_plain  # noqa: F401
from pipelines.core.params.base import (  # noqa: F401
              INERT_KEY,
              PACKAGE,
              PARAMS_FILE,
              WHEN_ENABLED,
              AppliesWhen,
              ParamsError,
              Section,
              applies_when,
              field_docs,
              only_with,
)
from pipelines.core.params.data import (  # noqa: F401
              SYNTHETIC,
              IngestParams,
              PrepareDataParams,
              SampleDataParams,
              SampleImagesParams,
              SourceFormat,
              SourceKind,
              SourceParams,
              TokenizeParams,
              ToolArithmeticParams,
              TrainTokenizerParams,
)
from pipelines.core.params.finetuning import (  # noqa: F401
              ALL_PROJECTIONS,
              FOUR_BIT,
              IN_TRAINING,
              LORA_STAGE_ADAPTER,
              PLAIN_LORA_ONLY,
              QUANTIZED,
              WITH_A_BASE,
              AdaptiveParams,
              BaseModelParams,
              FinetuneParams,
              LoraAdapterParams,
              LoraParams,
              MultimodalParams,
              ProbeLoraParams,
              QuantizationParams,
              QuantumOptParams,
              SftParams,
              VisionParams,
              adapter_moved,
)
from pipelines.core.params.preference import DPO_LOSS_TYPES, PREFERENCE_METHODS, DpoParams, RefLogprobsParams  # noqa: F401
from pipelines.core.params.pretraining import (  # noqa: F401
              ActivationCacheParams,
              DiffusionParams,
              EndToEndParams,
              MemoryParams,
              ModelParams,
              PretrainParams,
              ProgressiveParams,
)
from pipelines.core.params.project import Params, ProbeDeviceParams  # noqa: F401
from pipelines.core.params.release import EvaluateParams, ExportParams, GgufType, ModelStage, RegisterParams  # noqa: F401
from pipelines.core.params.rl import WITH_TOOLS, GrpoParams, RewardParams, ToolsParams  # noqa: F401
from pipelines.core.params.training import DEFAULT_EXTENSIONS, CurriculumParams, TrainParams  # noqa: F401

warnings.warn("pipelines.core.config is pipelines.core.params now (Params: pipelines.core.params.project; digest, flatten, "
              "to_plain: pipelines.core.outputs); the old name goes in the next release", DeprecationWarning, stacklevel=2)
