"""What tokaudit must say about each recorded scenario (held here, apart from the scenarios)."""

from __future__ import annotations

EXPECTED_CODES: dict[str, set[str]] = {
    "correct_token_mean_ga": set(),
    "correct_token_mean_w3": set(),
    "correct_sum_hook": set(),
    "correct_token_mean_one_micro": set(),
    "correct_sum_hook_one_micro": set(),
    "correct_empty_update_skipped": {"empty_update"},
    "correct_uneven_microbatches": set(),
    "correct_token_mean_reported_local_means": {"reported_loss_mismatch"},  # the verdict is about the gradient
    "bug_uneven_microbatches_local_mean": {"local_mean"},
    "bug_local_mean": {"local_mean", "reported_loss_mismatch"},
    "bug_local_mean_accumulation": {"local_mean", "reported_loss_mismatch"},
    "bug_per_micro_denominator": {"per_micro_denominator"},
    "bug_missing_world_size": {"world_size_mismatch"},
    "bug_hard_coded_world_size": {"world_size_mismatch"},
    "bug_global_world_size_on_dp_group": {"world_size_mismatch"},
    "inconclusive_balanced_local_mean": {"balanced_counts"},
    # scenarios/setups.py: the float64 reference in tests/distributed/test_setups.py decides which are correct
    "amp_told": set(),
    "amp_untold": {"loss_scale"},
    "nan_guard_skip": set(),
    "aux_head_named": set(),
    "aux_head_captured": set(),
    "aux_head_local_mean": {"local_mean"},
    "chunked_cross_entropy": set(),
    "chunked_cross_entropy_copied": set(),
    "chunked_cross_entropy_named": {"terms_one_objective"},  # three terms, one token mean over their tokens
    "chunked_cross_entropy_chunk_means": {"unexplained_weighting", "nonuniform_in_microbatch"},
    "mtp_heads": set(),
    "zero_grad_inside_accumulation": {"missing_sync", "scale_mismatch"},
    "near_miss_local_mean": {"local_mean"},
    "ignored_positions_summed": set(),
    "padding_labelled": {"masked_tokens_weighted"},
    "unknown_hook_right": {"unknown_divisor"},
    "unknown_hook_wrong": {"unknown_divisor"},
    "counted_positions": {"count_mismatch"},
    "elastic_stale_w": {"world_size_mismatch", "world_size_changed"},
}

SETUP_VERDICT: dict[str, str] = {
    "amp_told": "correct",
    "amp_untold": "inconclusive",
    "nan_guard_skip": "correct",
    "aux_head_named": "correct",
    "aux_head_captured": "correct",
    "aux_head_local_mean": "incorrect",
    "chunked_cross_entropy": "correct",
    "chunked_cross_entropy_copied": "correct",
    "chunked_cross_entropy_named": "correct",
    "chunked_cross_entropy_chunk_means": "incorrect",
    "mtp_heads": "correct",
    "near_miss_local_mean": "incorrect",
    "zero_grad_inside_accumulation": "incorrect",
    "ignored_positions_summed": "correct",
    "padding_labelled": "incorrect",
    "unknown_hook_right": "inconclusive",
    "unknown_hook_wrong": "inconclusive",
    "counted_positions": "inconclusive",
    "elastic_stale_w": "incorrect",
}

EXPECTED_VERDICT: dict[str, str] = {
    run: SETUP_VERDICT.get(run)
    or ("correct" if run.startswith("correct_") else "inconclusive" if run.startswith("inconclusive_") else "incorrect")
    for run in EXPECTED_CODES
}

# Recovered normalization: (denominator, α in b·g = α·S/denominator).
EXPECTED_NORMALIZATION: dict[str, tuple[str, float]] = {
    "correct_token_mean_ga": ("N", 2.0),
    "correct_token_mean_w3": ("N", 3.0),
    "correct_sum_hook": ("N", 1.0),
    "correct_token_mean_one_micro": ("N", 3.0),
    "correct_sum_hook_one_micro": ("N", 1.0),
    "correct_empty_update_skipped": ("N", 2.0),
    "correct_uneven_microbatches": ("N", 2.0),
    "correct_token_mean_reported_local_means": ("N", 2.0),
    "bug_local_mean": ("n_rank", 1.0),
    "bug_uneven_microbatches_local_mean": ("n_micro", 1.0),
    "bug_local_mean_accumulation": ("n_micro*M", 1.0),
    "bug_per_micro_denominator": ("N_m", 1.0),
    "bug_missing_world_size": ("N", 1.0),
    "bug_hard_coded_world_size": ("N", 8.0),
    "bug_global_world_size_on_dp_group": ("N", 4.0),
    "inconclusive_balanced_local_mean": ("undetermined", 2.0),
    "amp_told": ("N", 2.0),
    "nan_guard_skip": ("N", 2.0),
    "aux_head_named": ("N", 2.0),
    "aux_head_captured": ("N", 2.0),
    "aux_head_local_mean": ("N", 2.0),  # the main term; the auxiliary one is in `segments`
    "chunked_cross_entropy": ("N", 2.0),
    "chunked_cross_entropy_copied": ("N", 2.0),
    "chunked_cross_entropy_named": ("N", 2.0),
    "mtp_heads": ("N", 2.0),
    "ignored_positions_summed": ("N", 2.0),
    "elastic_stale_w": ("N", 3.0),  # 3·S/N throughout: right on 3 ranks, stale on 2
}
