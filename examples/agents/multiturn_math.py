"""A multi-turn math agent: answer, hear "incorrect" when wrong, reflect and retry.

It talks to the model only through ``client`` (the OpenAI chat-completions call shape), so the
same code runs against areal_fast's in-process client, its local endpoint, or any OpenAI-
compatible server. Reward: γ^k if the answer is first right at turn k (k = 0, 1, ...), 0 if
no turn within ``max_turns`` is right.

Train it (GSM8K from the shared data folder, or the offline arithmetic task):

    areal-fast train --config examples/agent_multiturn.yaml
"""

from areal_fast.data.rewards import DEFAULT_INSTRUCTION, build_prompt_messages, math_reward

FEEDBACK = (
    "Your answer is incorrect. Reflect on where the reasoning went wrong, then try "
    "again. Give only the final answer as a number."
)


class MultiTurnMathAgent:
    """Answers ``data["question"]`` in up to ``max_turns`` turns.

    Parameters
    ----------
    max_turns : int
        Attempts (1 = the plain single-turn task).
    turn_discount : float
        γ: a right answer at turn k earns γ^k.
    instruction : str
        Appended to the question (the answer format).
    feedback : str
        The user turn after a wrong answer.
    """

    def __init__(
        self,
        max_turns: int = 3,
        turn_discount: float = 0.9,
        instruction: str = DEFAULT_INSTRUCTION,
        feedback: str = FEEDBACK,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns = {max_turns} must be >= 1")
        self.max_turns, self.turn_discount = max_turns, turn_discount
        self.instruction, self.feedback = instruction, feedback

    async def run_agent_return_reward(self, data: dict, client) -> float:
        """Run one episode on ``data`` ({"question", "answer"}); returns its reward."""
        messages = build_prompt_messages(data["question"], self.instruction)
        for turn in range(self.max_turns):
            response = await client.chat.completions.create(model="policy", messages=messages)
            reply = response.choices[0].message.content or ""
            if math_reward(reply, data["answer"]) == 1.0:
                return self.turn_discount**turn
            messages = messages + [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": self.feedback},
            ]
        return 0.0
