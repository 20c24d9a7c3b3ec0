"""The speculative scenario's requests: chats whose answers copy the prompt, and chats whose answers do not.

- grounded: an instruction (copy, correct, extract, summarize) over a passage given in the prompt, so
  the answer repeats spans of the prompt: what prompt lookup and a draft model can guess;
- chat: open questions whose answers are nowhere in the prompt.

Each prompt is a chat (the model's chat template), so an instruct model answers it as a user would
see it; the rows of a run take the prompts in order, cycling when there are more rows than prompts.
"""

from __future__ import annotations

from typing import Any

from mlxq.bench.workloads import Prompt

SPEC_WORKLOADS = ("grounded", "chat")

PASSAGES = (
    "The lighthouse on the northern cape was built in 1871 from granite cut on the island itself. Its lamp "
    "burned whale oil at first, then kerosene, and since 1954 an electric bulb that a keeper no longer tends. "
    "Ships passing the cape still count its flashes: three short ones every fifteen seconds.",
    "To bake a simple loaf, mix 500 grams of flour with 350 grams of warm water, 10 grams of salt and 7 grams "
    "of dried yeast. Knead the dough for ten minutes, let it rise for an hour, shape it, and let it rise again. "
    "Bake it at 230 degrees for about 35 minutes, until the crust is brown.",
    "A message queue sits between the programs that ask for work and the programs that do it. The web server "
    "puts a job on the queue and returns at once; a worker takes the job when it has room, runs it, and writes "
    "the result where the web server can read it later.",
    "The river rises in the hills above the old mill and runs for 42 kilometres to the sea. Trout live in its "
    "upper reaches, where the water is cold and fast. Lower down it widens and slows, and herons wait in the "
    "reeds for the fish that the current brings them.",
    "Maria opened the bakery on Station Road in 1998 with two ovens and a borrowed van. Today it employs "
    "eleven people and sells four hundred loaves on a Saturday. She still starts work at four in the morning, "
    "because, she says, the dough does not wait for anyone.",
    "Each decode step of a language model reads all of its weights to produce one token for each sequence in "
    "the batch. When the batch is small, most of that reading is wasted, so the step costs about the same "
    "whether it serves one sequence or eight.",
    "The museum will be closed from the 3rd to the 14th of March while the roof of the east wing is repaired. "
    "The cafe and the shop stay open. Tickets already bought for those dates can be exchanged at the front "
    "desk or refunded by writing to the visitor office.",
    "Honey bees visit up to two thousand flowers in a day. A forager that finds a good patch returns to the "
    "hive and dances: the angle of the dance tells the others the direction of the flowers, and its length "
    "tells them how far away they are.",
)

# Each asks for an answer made mostly of the passage's own words.
INSTRUCTIONS = (
    "Copy the following text exactly, word for word.",
    "Correct the spelling mistakes in the following text and write out the whole corrected text.",
    "Rewrite the following text as a bulleted list, one sentence per bullet, keeping the wording.",
    "Summarize the following text in two sentences, reusing its words.",
)

QUESTIONS = (
    "Write a short poem about the first snow of winter.",
    "What are three good habits for staying healthy while working at a desk?",
    "Why is the sky blue? Explain it simply.",
    "Give me some ideas for a birthday party for a ten-year-old.",
    "What is the difference between weather and climate?",
    "Write a short story about a cat who wants to become a sailor.",
    "How do I make a good cup of tea?",
    "What should I pack for a weekend hiking trip?",
    "Explain what a computer program is to a child.",
    "Suggest three names for a small coffee shop, and say why.",
    "What are the benefits of learning a second language?",
    "Describe a perfect Sunday morning.",
    "How can I sleep better at night?",
    "Why do leaves change colour in autumn?",
    "Write a friendly message inviting my neighbours to a street party.",
    "What are some fun things to do on a rainy day?",
    "How does a bicycle stay upright when it moves?",
    "Give me tips for keeping houseplants alive.",
    "What makes a good friend?",
    "Explain how a rainbow forms.",
    "Write a limerick about a forgetful wizard.",
    "What are the planets of the solar system, and which is the largest?",
    "How do I start learning to play the guitar?",
    "Why do we have seasons on Earth?",
    "Write a thank-you note to a teacher.",
    "What are some simple ways to save money each month?",
    "Describe the sound of the ocean to someone who has never heard it.",
    "What should I think about before adopting a dog?",
    "How do bees make honey?",
    "Write a short speech to open a school sports day.",
    "What is a healthy breakfast that takes five minutes to make?",
    "Tell me about the history of the bicycle.",
)


def misspell(text: str, every: int = 4) -> str:
    """The text with the two middle letters of every `every`-th word of five letters or more
    swapped: spelling mistakes to correct, the rest untouched."""
    words = text.split(" ")
    count = 0
    for i, word in enumerate(words):
        core = word.rstrip(".,;:!?")
        if len(core) >= 5 and core.isalpha():
            count += 1
            if count % every == 0:
                mid = len(core) // 2
                words[i] = core[:mid - 1] + core[mid] + core[mid - 1] + core[mid + 1:] + word[len(core):]
    return " ".join(words)


def grounded_messages() -> list[list[dict[str, str]]]:
    """Every instruction over every passage: 32 distinct chats, the instructions interleaved so that
    any first N of them mix all four."""
    chats = []
    for p_index in range(len(PASSAGES)):
        for i_index, instruction in enumerate(INSTRUCTIONS):
            passage = PASSAGES[(p_index + i_index) % len(PASSAGES)]
            if i_index == 1:
                passage = misspell(passage)
            chats.append([{"role": "user", "content": f"{instruction}\n\n{passage}"}])
    return chats


def chat_messages() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": question}] for question in QUESTIONS]


def spec_prompts(tokenizer: Any, kind: str, count: int) -> list[Prompt]:
    """`count` prompts of workload `kind` through the tokenizer's chat template, cycling through
    the kind's chats when more are asked than it has."""
    if kind not in SPEC_WORKLOADS:
        raise ValueError(f"--spec-workloads: unknown workload {kind!r}; choose from {','.join(SPEC_WORKLOADS)}")
    chats = grounded_messages() if kind == "grounded" else chat_messages()
    prompts = []
    for i in range(count):
        messages = chats[i % len(chats)]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict):  # some tokenizers return their BatchEncoding
            ids = ids["input_ids"]
        prompts.append(Prompt(messages[-1]["content"], tuple(int(t) for t in ids)))
    return prompts
