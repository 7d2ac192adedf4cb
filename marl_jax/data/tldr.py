"""Reddit TL;DR: openai/summarize_from_feedback ("comparisons") and the TL;DR SFT set.

Comparison rows: `{info: {id, post, title, subreddit, article, site}, summaries: [{text, policy,
note}, {text, ...}], choice: 0 | 1, worker, batch, split, extra}`.

Prompts use the public TL;DR format (as in TRL's tldr scripts and the OpenAI summarisation work):

    SUBREDDIT: r/{subreddit}\\n\\nTITLE: {title}\\n\\nPOST: {post}\\n\\nTL;DR:

and a summary is the completion " {text}": the stored summary stripped, with one leading space so
that it continues "TL;DR:" the way the original model samples did. The validation split also holds
CNN/DailyMail comparisons (batches "batch0_cnndm", "cnndm0", "cnndm2"); they are dropped unless
`include_cnndm=True`, in which case their prompt is "Article:\\n{article}\\n\\nTL;DR:".

The SFT set CarperAI/openai_summarize_tldr has rows `{prompt, label}`; its prompt is used as
stored and the label becomes " {label}".
"""
from marl_jax.data.records import BadRow, DroppedRow, check_text, field, text_field

PROMPT_FORMAT = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
CNNDM_PROMPT_FORMAT = "Article:\n{article}\n\nTL;DR:"
CNNDM_BATCHES = ("batch0_cnndm", "cnndm0", "cnndm2")


def completion(text):
    """A summary as the completion of "TL;DR:": stripped, one leading space."""
    return " " + text.strip()


def prompt(row, *, include_cnndm=False):
    """The formatted prompt of a comparison row."""
    if row.get("batch") in CNNDM_BATCHES:
        if not include_cnndm:
            raise DroppedRow("CNN/DailyMail row (include_cnndm=False)")
        return CNNDM_PROMPT_FORMAT.format(article=text_field(row, "info.article"))
    return PROMPT_FORMAT.format(subreddit=text_field(row, "info.subreddit"),
                                title=text_field(row, "info.title"),
                                post=text_field(row, "info.post"))


def preference_pair(row, *, include_cnndm=False):
    choice = field(row, "choice")
    if choice not in (0, 1):
        raise BadRow("choice not 0 or 1")
    summaries = field(row, "summaries")
    if not isinstance(summaries, list) or len(summaries) != 2:
        raise BadRow("summaries is not a list of two")
    texts = [check_text((summaries[i] or {}).get("text"), f"summaries[{i}].text") for i in (0, 1)]
    return {
        "prompt": prompt(row, include_cnndm=include_cnndm),
        "chosen": completion(texts[choice]),
        "rejected": completion(texts[1 - choice]),
        "id": field(row, "info.id"),
    }


def prompt_record(row, *, include_cnndm=False):
    return {"prompt": prompt(row, include_cnndm=include_cnndm), "id": field(row, "info.id")}


def sft_example(row, *, include_cnndm=False):
    pair = preference_pair(row, include_cnndm=include_cnndm)
    return {"prompt": pair["prompt"], "response": pair["chosen"], "id": pair["id"]}


def sft_set_example(row):
    """A row of CarperAI/openai_summarize_tldr: `{prompt, label}`."""
    return {"prompt": text_field(row, "prompt"), "response": completion(text_field(row, "label"))}


def sft_set_prompt(row):
    return {"prompt": text_field(row, "prompt")}
