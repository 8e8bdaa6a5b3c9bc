"""pipelines/core/rl/tools.py: the built-in calculator and lookup, a user's tool, calls that
raise, hang or return garbage, and tool calls read back from what the published chat templates
render."""

from __future__ import annotations

import random
import sys
import textwrap
import time

import pytest

from pipelines.core.rl import tools
from pipelines.core.rl.tools import Observation, ToolCall, ToolEnvironment
from tests.chat_families import HERMES, LLAMA31_TOOLS, QWEN25, tokenizer_for


def calc(expression: str) -> Observation:
    return ToolEnvironment([tools.load("calculator")]).step(ToolCall("calculator", {"expression": expression}))


def test_the_calculator_multiplies_and_adds_what_a_small_model_cannot_in_its_head():
    rng = random.Random(0)
    for _ in range(50):
        a, b, c = rng.randrange(10**5, 10**7), rng.randrange(10**5, 10**7), rng.randrange(1, 10**4)
        assert calc(f"{a} * {b} + {c}") == Observation(str(a * b + c))
        terms = [rng.randrange(-(10**6), 10**6) for _ in range(6)]
        assert calc(" + ".join(f"({t})" for t in terms)) == Observation(str(sum(terms)))
    assert calc("2 + 3 * 4 ** 2 // 5 - -1") == Observation(str(2 + 3 * 4**2 // 5 + 1))
    assert calc("7 / 2") == Observation("3.5") and calc("10 / 4 * 2") == Observation("5") and calc("17 % 5") == Observation("2")
    assert calc("1 / 3") == Observation("0.333333333333")


@pytest.mark.parametrize("expression, says", [
    ("__import__('os').system('true')", "Call is not arithmetic"),
    ("(1).real", "Attribute is not arithmetic"),
    ("x + 1", "Name is not arithmetic"),
    ("'a' * 3", "the constant 'a' is not arithmetic"),
    ("True + 1", "the constant True is not arithmetic"),
    ("[1, 2]", "List is not arithmetic"),
    ("(lambda: 1)()", "Call is not arithmetic"),
    ("1 if 1 else 2", "IfExp is not arithmetic"),
    ("2 < 3", "Compare is not arithmetic"),
    ("9 ** 9 ** 9", "an exponent must be a whole number from -64 to 64"),
    ("2 ** 0.5", "an exponent must be a whole number"),
    ("(10 ** 60) ** 60", "a number past 4096 bits"),
    ("1e308 * 10", "not a finite number"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("1 +", "is not an arithmetic expression"),
    ("1" + " + 1" * 40, "too long (more than 64 parts)"),
    ("1" * 300, "300 characters; at most 256"),
])  # fmt: skip
def test_the_calculator_refuses_all_but_bounded_arithmetic_with_a_message_the_model_reads(expression, says):
    started = time.perf_counter()
    observation = calc(expression)
    assert observation.error == "raised" and observation.content.startswith("error: calculator: ") and says in observation.content, observation
    assert time.perf_counter() - started < 1.0  # refused before computing anything large


def test_the_lookup_answers_from_the_datas_table_and_an_unknown_key_is_an_error():
    env = ToolEnvironment([tools.load("lookup", table={"Tovik": "Pelora", "Marela Dun": "Dunmar"})])
    assert env.step(ToolCall("lookup", {"key": "tovik"})) == Observation("Pelora")
    assert env.step(ToolCall("lookup", {"key": " marela   dun "})) == Observation("Dunmar")
    assert env.step(ToolCall("lookup", {"key": "Sanit"})) == Observation("error: lookup: no entry for 'Sanit'", "raised")
    with pytest.raises(tools.ToolError, match="tools: the lookup tool answers from a table the data provides"):
        tools.load("lookup")


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    (tmp_path / "mytools.py").write_text(textwrap.dedent('''
        import time

        def weather(city: str, days: int = 1) -> str:
            """The forecast for a city.

            Args:
                city: The city's name.
                days: How many days ahead.
            """
            return f"{city}: sunny for {days} day(s)"

        def broken(city: str) -> str:
            """Always fails.

            Args:
                city: A city.
            """
            raise RuntimeError("the weather service is down")

        def hangs(city: str) -> str:
            """Never answers.

            Args:
                city: A city.
            """
            time.sleep(30)

        def garbage(city: str) -> object:
            """Returns an object.

            Args:
                city: A city.
            """
            return object()

        def chatty(city: str) -> list:
            """Returns a long list.

            Args:
                city: A city.
            """
            return [city] * 1000

        def undocumented(city):
            return city

        not_a_function = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("mytools", None)


def test_a_users_tool_loads_with_the_schema_of_its_hints_and_docstring(user_tools):
    weather = tools.load("mytools:weather")
    assert weather.name == "weather"
    assert weather.schema["function"]["parameters"] == {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string", "description": "The city's name."}, "days": {"type": "integer", "description": "How many days ahead."}},
    }  # fmt: skip
    env = ToolEnvironment([weather])
    assert env.step(ToolCall("weather", {"city": "Pelora", "days": 2})) == Observation("Pelora: sunny for 2 day(s)")
    assert env.step(ToolCall("weather", {"city": "Pelora", "days": "2"})) == Observation("error: weather: days must be integer, got str", "bad_arguments")
    assert env.step(ToolCall("weather", {"days": 2})) == Observation("error: weather: missing city", "bad_arguments")
    assert env.step(ToolCall("weather", {"city": "P", "when": 1})).error == "bad_arguments"
    assert env.step(ToolCall("forecast", {})) == Observation("error: no tool named 'forecast' (there are: weather)", "unknown_tool")


@pytest.mark.parametrize("spec, says", [
    ("mytools:undocumented", "'undocumented' cannot be described to the model"),
    ("mytools:not_a_function", "is a int, not a tool function"),
    ("mytools:nothing", "module 'mytools' has no 'nothing'"),
    ("nomodule:fn", "cannot import module 'nomodule'"),
    ("eval", "neither a built-in tool (calculator, lookup) nor `package.module:function`"),
])  # fmt: skip
def test_a_tool_that_cannot_be_loaded_or_described_is_refused_naming_it(user_tools, spec, says):
    with pytest.raises(tools.ToolError, match="^grpo.tools\\[0\\]: ") as error:
        tools.load(spec, "grpo.tools[0]")
    assert says in str(error.value)


def test_the_built_in_tools_are_the_names_params_accept():
    from pipelines.core.extensions import BUILT_IN_TOOLS

    assert tools.BUILT_IN == BUILT_IN_TOOLS


def test_a_tool_that_raises_hangs_or_returns_garbage_is_an_observation_and_the_caller_goes_on(user_tools):
    env = ToolEnvironment([tools.load(f"mytools:{name}") for name in ("broken", "hangs", "garbage", "chatty")], timeout=0.3)
    assert env.step(ToolCall("broken", {"city": "P"})) == Observation("error: broken: the weather service is down", "raised")
    started = time.perf_counter()
    assert env.step(ToolCall("hangs", {"city": "P"})) == Observation("error: hangs did not answer within 0.3 s", "timeout")
    assert time.perf_counter() - started < 2.0
    assert env.step(ToolCall("garbage", {"city": "P"})) == Observation("error: garbage returned a object, which is neither text nor JSON", "bad_result")
    long = env.step(ToolCall("chatty", {"city": "P"}))
    assert long.error == "bad_result" and len(long.content) == tools.MAX_RESULT_CHARS and long.content.startswith('["P", "P"')
    with pytest.raises(tools.ToolError, match="two tools share a name \\(calculator\\)"):
        ToolEnvironment([tools.load("calculator"), tools.load("calculator")])


CALL = ToolCall("calculator", {"expression": "48213 * 977"})


@pytest.mark.parametrize("family, style", [(QWEN25, "hermes"), (HERMES, "hermes"), (LLAMA31_TOOLS, "llama3")])
def test_a_call_rendered_by_the_published_template_parses_back_to_the_same_call(family, style):
    """The chat template renders an assistant turn that carries `tool_calls` (OpenAI's layout); the
    parser for the template's style reads the same call out of that text."""
    tokenizer = tokenizer_for(family, ["What is 48213 times 977?", "calculator expression"])
    schema = tools.load("calculator").schema
    question = [{"role": "user", "content": "What is 48213 times 977?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": CALL.name, "arguments": CALL.arguments}}]}
    before = tokenizer.apply_chat_template(question, tools=[schema], tokenize=False, add_generation_prompt=True)
    after = tokenizer.apply_chat_template([*question, turn], tools=[schema], tokenize=False)
    assert "calculator" in before and after.startswith(before)  # the tool's schema is in the prompt; the turn is appended
    generated = after[len(before):].split(family.end_of_turn)[0]  # what the model would generate, up to its end of turn
    parsed = tools.parse_tool_calls(generated, style)
    assert parsed.calls == [CALL] and parsed.failure is None and parsed.text == ""


def test_hermes_style_reads_several_calls_text_around_them_and_string_arguments():
    text = ('Let me compute both. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"Tovik\\"}"}</tool_call>')  # fmt: skip
    parsed = tools.parse_tool_calls(text, "hermes")
    assert parsed == tools.Parsed([ToolCall("calculator", {"expression": "2+2"}), ToolCall("lookup", {"key": "Tovik"})], "Let me compute both.")
    assert tools.parse_tool_calls("The answer is 4.", "hermes") == tools.Parsed([], "The answer is 4.")


@pytest.mark.parametrize("text, style, failure", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}', "hermes", "<tool_call> without </tool_call>"),
    ("<tool_call>{name: calculator}</tool_call>", "hermes", "<tool_call> block not read: Expecting property name"),
    ('<tool_call>{"arguments": {}}</tool_call>', "hermes", "a tool call needs the function's 'name'"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "hermes", "a tool call's arguments must be a JSON object, got list"),
    ('{"name": "calculator", "parameters": {"expression": "2+2"', "llama3", "JSON tool call not read"),
])  # fmt: skip
def test_a_call_that_cannot_be_read_is_a_parse_failure_not_a_crash(text, style, failure):
    parsed = tools.parse_tool_calls(text, style)
    assert parsed.calls == [] and parsed.failure is not None and failure in parsed.failure, parsed
    with pytest.raises(tools.ToolError, match="tool-call style 'xml': expected one of hermes, llama3"):
        tools.parse_tool_calls(text, "xml")
