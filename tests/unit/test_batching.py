"""Grouping a TorchServe batch into pipeline calls."""

from handler.batching import CallInputs, CallKey, group_requests
from handler.request import GenerationRequest, RequestPolicy


def make(**fields) -> GenerationRequest:
    return GenerationRequest.model_validate({"prompt": "p", "seed": 0, **fields}, context=RequestPolicy())


def test_compatible_requests_share_one_call_in_arrival_order():
    requests = {0: make(prompt="a"), 1: make(prompt="b", negative_prompt="n"), 2: make(prompt="c", seed=9)}
    calls = group_requests(requests, max_images_per_call=16)
    assert [call.members for call in calls] == [(0, 1, 2)]
    assert calls[0].key == CallKey(512, 512, 25, "ddim", 7.5)


def test_requests_that_must_differ_get_separate_calls():
    requests = {
        0: make(),
        1: make(width=256),
        2: make(num_inference_steps=10),
        3: make(scheduler="euler"),
        4: make(guidance_scale=1.0),
        5: make(height=256),
        6: make(prompt="same as 0 otherwise"),
    }
    calls = group_requests(requests, max_images_per_call=16)
    assert [call.members for call in calls] == [(0, 6), (1,), (2,), (3,), (4,), (5,)]


def test_output_options_do_not_split_a_call():
    requests = {0: make(output_format="jpeg"), 1: make(response_format="json"), 2: make(num_images_per_prompt=2)}
    assert [call.members for call in group_requests(requests, 16)] == [(0, 1, 2)]


def test_calls_are_capped_by_images_without_splitting_a_request():
    requests = {0: make(num_images_per_prompt=3), 1: make(num_images_per_prompt=2), 2: make(), 3: make(num_images_per_prompt=4)}
    calls = group_requests(requests, max_images_per_call=4)
    assert [call.members for call in calls] == [(0,), (1, 2), (3,)]
    assert [call.image_count(requests) for call in calls] == [3, 3, 4]


def test_every_request_lands_in_exactly_one_call():
    requests = {index: make(width=64 * (1 + index % 3), num_images_per_prompt=1 + index % 4) for index in range(20)}
    calls = group_requests(requests, max_images_per_call=5)
    members = [index for call in calls for index in call.members]
    assert sorted(members) == list(range(20))
    assert all(call.image_count(requests) <= 5 for call in calls)


def test_no_requests_no_calls():
    assert group_requests({}, 4) == []


def test_call_inputs_expand_images_and_hand_them_back_to_their_owners():
    requests = {3: make(prompt="a", seed=5, num_images_per_prompt=2), 7: make(prompt="b", negative_prompt="n", seed=1)}
    (call,) = group_requests(requests, 16)
    inputs = CallInputs.of(call, requests)
    assert inputs.prompts == ["a", "a", "b"]
    assert inputs.negative_prompts == ["", "", "n"]
    assert inputs.seeds == [5, 6, 1]
    assert inputs.split_by_owner(["img5", "img6", "img1"]) == {3: ["img5", "img6"], 7: ["img1"]}
