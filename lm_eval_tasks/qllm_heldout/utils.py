"""lm-evaluation-harness glue of the `qllm_heldout` task; what it does is `pipelines.core.evaluation.lm_eval`."""

from lm_eval.api.task import ConfigurableTask

from pipelines.core.evaluation.lm_eval import heldout_docs, process_results, render_prompt

__all__ = ["HeldoutTask", "heldout_docs", "process_results"]


class HeldoutTask(ConfigurableTask):
    """A generation task whose prompt is the document's whole conversation (system message and
    earlier turns included) rendered by the model's chat template, not one question in a user turn."""

    def __init__(self, config: dict | None = None) -> None:
        # lm_eval passes the YAML's keys, `class` (this class) among them, which TaskConfig has not
        super().__init__(config={key: value for key, value in (config or {}).items() if key != "class"})

    def fewshot_context(self, doc, num_fewshot, system_instruction=None, apply_chat_template=False, chat_template=None, **_):
        return render_prompt(doc, chat_template if apply_chat_template else None, num_fewshot, system_instruction)
