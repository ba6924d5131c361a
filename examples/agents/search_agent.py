"""A search agent: the model calls a ``search`` tool over a local BM25 index, then answers.

Each question of the task written by ``make_search_corpus.py`` needs two retrievals (the
document of the entity it names gives a second entity, whose document holds the answer). The
tool list goes to the model in the OpenAI ``tools`` format; each ``search(query)`` call comes
back as ``message.tool_calls`` and its top-k passages go back as a ``{"role": "tool"}``
message. The first reply without a tool call is the final answer. Reward: 1 if the
normalised final answer equals the normalised gold answer (exact match), else 0.

The BM25 index (the ``bm25s`` library, ``pip install areal-fast[search]``) is built once
per process and corpus file, at the agent's construction, and shared by every session.

    python examples/agents/make_search_corpus.py examples/agents/search_data
    areal-fast train --config examples/agent_search.yaml
"""

from __future__ import annotations

import functools
import json
import re
import string
from pathlib import Path

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the document collection; returns the best matching passages.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "keywords or a name"}},
            "required": ["query"],
        },
    },
}
INSTRUCTION = (
    "Use the search tool to look up facts, one entity per search. When you know the answer, "
    "reply with 'Answer: ' followed by the answer only."
)


def _demo_call(number: int, query: str) -> dict:
    arguments = json.dumps({"query": query})
    function = {"name": "search", "arguments": arguments}
    call = {"id": f"demo-{number}", "type": "function", "function": function}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


# one worked episode about entities that are not in the corpus, shown before the question
DEMONSTRATION = [
    {
        "role": "user",
        "content": f"In which city was the founder of Quillon Works born?\n{INSTRUCTION}",
    },
    _demo_call(1, "Quillon Works"),
    {
        "role": "tool",
        "tool_call_id": "demo-1",
        "content": "[1] Quillon Works is a mining company founded in 1961 by Yevo Carrandi.",
    },
    _demo_call(2, "Yevo Carrandi"),
    {
        "role": "tool",
        "tool_call_id": "demo-2",
        "content": "[1] Yevo Carrandi is a pilot, born in 1932 in the city of Ostravel.",
    },
    {"role": "assistant", "content": "Answer: Ostravel"},
]
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and the articles a/an/the removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def final_answer(reply: str) -> str:
    """The text after the last ``Answer:`` of ``reply`` (the whole reply if it has none)."""
    parts = _ANSWER.split(reply)
    return parts[-1].strip()


def exact_match(reply: str, gold: str) -> float:
    """1.0 if the final answer of ``reply`` equals ``gold`` once both are normalised."""
    predicted = normalize_answer(final_answer(reply))
    return 1.0 if predicted and predicted == normalize_answer(str(gold)) else 0.0


class SearchIndex:
    """BM25 (``bm25s``, Lucene variant, English stop words) over ``{"id", "title", "text"}``
    documents.

    Parameters
    ----------
    docs : list of dict
        The corpus; ``title`` and ``text`` are indexed.
    """

    def __init__(self, docs: list[dict]):
        try:
            import bm25s
        except ImportError:
            message = "the search agent needs bm25s: pip install 'areal-fast[search]'"
            raise ImportError(message) from None

        self._bm25s = bm25s
        self.docs = docs
        self.retriever = bm25s.BM25()
        self.retriever.index(
            self._tokens([f"{d['title']}. {d['text']}" for d in docs]), show_progress=False
        )

    def _tokens(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", show_progress=False, return_ids=False)

    def search(self, query: str, k: int = 3) -> list[dict]:
        """The (at most) ``k`` best documents for ``query``, best first; documents sharing no
        word with it are left out (an empty list when none does)."""
        k = min(k, len(self.docs))
        ids, scores = self.retriever.retrieve(self._tokens([query]), k=k, show_progress=False)
        return [self.docs[int(i)] for i, s in zip(ids[0], scores[0]) if s > 0]


@functools.lru_cache(maxsize=4)
def load_index(corpus: str) -> SearchIndex:
    """The :class:`SearchIndex` of a ``corpus.jsonl`` file, built once per process and path.

    Raises
    ------
    ValueError
        The file is missing, empty, or a line is not a document (naming the file and line).
    """
    path = Path(corpus)
    if not path.is_file():
        raise ValueError(
            f"corpus = {corpus!r}: no such file (write it with "
            f"python examples/agents/make_search_corpus.py {path.parent})"
        )
    docs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{corpus} line {number}: invalid JSON ({exc.msg})") from None
        missing = [k for k in ("id", "title", "text") if not isinstance(doc.get(k), str)]
        if missing:
            raise ValueError(f"{corpus} line {number}: {missing[0]!r} must be a string")
        docs.append(doc)
    if not docs:
        raise ValueError(f"{corpus}: file holds no documents")
    return SearchIndex(docs)


def format_passages(docs: list[dict]) -> str:
    """The tool's reply: numbered passages, or a line saying nothing matched."""
    if not docs:
        return "No matching documents."
    return "\n".join(f"[{i}] {d['text']}" for i, d in enumerate(docs, 1))


class SearchAgent:
    """Answers ``data["question"]`` with up to ``max_turns`` model calls, running each
    ``search`` call it makes against the corpus.

    Parameters
    ----------
    corpus : str
        ``corpus.jsonl`` written by ``make_search_corpus.py`` (relative to the working
        directory).
    top_k : int
        Passages per search.
    max_turns : int
        Model calls per episode; an episode still searching after them earns 0.
    instruction : str
        Appended to the question.
    demonstration : bool
        Start with :data:`DEMONSTRATION`, one worked episode (two searches, then the answer)
        about entities that are not in the corpus; small models rarely call a tool without it.

    Raises
    ------
    ValueError
        ``top_k`` or ``max_turns`` below 1, or a corpus that cannot be read.
    """

    def __init__(
        self,
        corpus: str = "examples/agents/search_data/corpus.jsonl",
        top_k: int = 3,
        max_turns: int = 4,
        instruction: str = INSTRUCTION,
        demonstration: bool = True,
    ):
        if top_k < 1 or max_turns < 1:
            raise ValueError(f"top_k = {top_k} and max_turns = {max_turns} must be >= 1")
        self.top_k, self.max_turns, self.instruction = top_k, max_turns, instruction
        self.demonstration = demonstration
        self.index = load_index(corpus)

    def run_tool(self, call) -> str:
        """The result text of one tool call (an error line for a bad name or arguments)."""
        if call.function.name != "search":
            return f"error: unknown tool {call.function.name!r}; the only tool is 'search'"
        try:
            query = json.loads(call.function.arguments).get("query")
        except (json.JSONDecodeError, AttributeError):
            query = None
        if not isinstance(query, str) or not query.strip():
            return "error: arguments must be a JSON object with a string 'query'"
        # a BM25 search over a few hundred documents takes well under a millisecond, so it
        # runs on the event loop; a slow retriever would go through asyncio.to_thread
        return format_passages(self.index.search(query, self.top_k))

    async def run_agent_return_reward(self, data: dict, client) -> float:
        """One episode on ``data`` ({"question", "answer"}); returns its exact-match reward."""
        messages = list(DEMONSTRATION) if self.demonstration else []
        messages.append({"role": "user", "content": f"{data['question']}\n{self.instruction}"})
        for _ in range(self.max_turns):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[SEARCH_TOOL]
            )
            message = response.choices[0].message
            if not message.tool_calls:
                return exact_match(message.content or "", data["answer"])
            messages = messages + [message.model_dump(exclude_none=True)]
            for call in message.tool_calls:
                result = self.run_tool(call)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0
