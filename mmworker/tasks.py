"""A job's task applied: the prompt, the response_format and the max_tokens it runs with.

Precedence, field by field: what the job says, then its task (`tasks.NAME` in the config), then
the built-in default (a caption prompt per media kind, free text, 128 tokens). A job without a
task and without a response_format runs exactly as before tasks existed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmworker_schemas.job import DEFAULT_PROMPTS, Job, ResponseFormat

from mmworker.config import TaskConfig
from mmworker.errors import InvalidResponseFormat, UnknownTask

#: What `{media}` in a task prompt becomes, by the kind of the job's media as sniffed.
MEDIA_WORDS: dict[str, str] = {"image": "image", "video": "video", "mixed": "images and videos"}


@dataclass(frozen=True, slots=True)
class Plan:
    task: str | None
    #: The job's own prompt; wins over the template.
    prompt: str | None
    #: The task's prompt, or one per kind (image, video, mixed).
    template: str | Mapping[Any, str]
    response_format: ResponseFormat | None

    def instruction(self, kinds: Sequence[str]) -> str:
        """The prompt once the media kinds are known (sniffed, not declared)."""
        if self.prompt:
            return self.prompt
        distinct = set(kinds)
        kind = distinct.pop() if len(distinct) == 1 else "mixed"
        text = self.template if isinstance(self.template, str) else self.template[kind]
        return text.replace("{media}", MEDIA_WORDS[kind])


def plan_job(job: Job, tasks: Mapping[str, TaskConfig]) -> tuple[Job, Plan]:
    """The job as it will run (a task's max_tokens applied where the job set none) and its plan.

    Raises UnknownTask, or InvalidResponseFormat for settings that would cut a guided answer
    (refused here, before anything is fetched).
    """
    task: TaskConfig | None = None
    if job.task is not None:
        task = tasks.get(job.task)
        if task is None:
            raise UnknownTask(
                f"task {job.task!r} is not one of this worker's tasks: {', '.join(sorted(tasks))}"
            )
    # Only where a job's own `segments` would be valid (one media item): model_copy skips the
    # Job's check, and segment mode reads the first item alone, so the other items of a
    # several-item job were dropped without a word. Such a job runs as one request.
    one_item = len(job.media) == 1
    if task is not None and task.segments is not None and job.segments is None and one_item:
        job = job.model_copy(update={"segments": task.segments})
    fmt = job.response_format or (task.response_format if task else None)
    generation = job.generation
    if task is not None and task.max_tokens and "max_tokens" not in generation.model_fields_set:
        generation = generation.model_copy(update={"max_tokens": task.max_tokens})
        job = job.model_copy(update={"generation": generation})
    if fmt is not None and generation.ignore_eos:
        raise InvalidResponseFormat(
            "generation.ignore_eos cannot be combined with a response_format: the answer would "
            "run on past its end"
        )
    if fmt is not None and generation.stop:
        raise InvalidResponseFormat(
            "generation.stop cannot be combined with a response_format: a stop string would cut "
            "the answer"
        )
    template = task.prompt if task is not None else DEFAULT_PROMPTS
    return job, Plan(job.task, job.prompt, template, fmt)
