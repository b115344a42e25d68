"""A tool written for verl, ported to polyrl by changing its imports (the two marked lines); nothing else changed.

It is shaped like verl's gsm8k demo tool: the model submits an answer, the tool scores it against the sample's ground
truth (from `extra_info.tools_kwargs.check_answer.create_kwargs.ground_truth`), answers with the score and returns a
step reward of -0.05 when a resubmission does not improve it. Load it with examples/tools/answer_check_tool.yaml.
"""

from typing import Any, Optional
from uuid import uuid4

# verl:  from verl.tools.base_tool import BaseTool
# verl:  from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from polyrl.tools.base_tool import BaseTool
from polyrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class AnswerCheckTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", kwargs.get("ground_truth"))
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float,
                                                                                             dict]:
        answer = str(parameters.get("answer", ""))
        self._instance_dict[instance_id]["response"] = answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > self._instance_dict[instance_id]["reward"] else -0.05
        self._instance_dict[instance_id]["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return 1.0 if state["response"].strip() == str(state["ground_truth"]).strip() else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
