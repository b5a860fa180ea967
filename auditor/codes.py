"""Stable finding codes, and the one table of what each says: severity, title, why, fix, worked example.

Tests and JSON match on the codes, never on the text. CODE_DOCS is the single source of `tokaudit explain`, of
docs/CODES.md (`scripts/write_codes_doc.py` writes it; a test fails when it is stale) and of DEFAULT_SEVERITY. The
codes themselves, their severities and the type of a code's documentation are `_code_names`'."""

from __future__ import annotations

from tokaudit._code_names import DEFAULT_RTOL, EXAMPLE_SETUP, Code, CodeDoc, Family, Severity

__all__ = ["DEFAULT_RTOL", "EXAMPLE_SETUP", "Code", "CodeDoc", "Family", "Severity"]

CODE_DOCS: dict[Code, CodeDoc] = {
    Code.LOCAL_MEAN: CodeDoc(
        Severity.ERROR,
        "ranks (or microbatches) weighted equally instead of tokens",
        family="weighting",
        why="Each rank backpropagates its local mean b_r = S_r/n_r. DDP averages, so a token on rank r gets "
        "e_r = 1/(W·n_r) instead of 1/N, and q_r = e_r·N = N/(W·n_r). The recovered denominator is the rank's "
        "own count (n_rank), or a microbatch's own count (n_micro, n_micro*M) under gradient accumulation.",
        fix="Count N over all microbatches of all ranks before the first backward (one all-reduce), then "
        "backpropagate W·S_r/N into DDP's average (or S_r/N into a summing reduction).",
        example="b0 = S0/1, b1 = S1/3; after the average e0 = 1/2 = 0.5, e1 = 1/6 ≈ 0.167: the lone token on rank 0 "
        "weighs 3× a token on rank 1 (q0 = 2, q1 = 0.667). With W·S_r/N: b0 = 2·S0/4, b1 = 2·S1/4, "
        "e = 0.25 everywhere.",
    ),
    Code.PER_MICRO_DENOMINATOR: CodeDoc(
        Severity.ERROR,
        "each microbatch divided by its own global count",
        family="weighting",
        why="The code all-reduces the count of each microbatch (N_m) but not of the step: b = W·S/(M·N_m). Tokens "
        "of a sparse microbatch weigh more: e = 1/(M·N_m) instead of 1/N, q = N/(M·N_m).",
        fix="Sum the counts of every microbatch of the step before the first backward (prefetch the step's "
        "batches or count labels up front) and divide every microbatch by that N.",
        example="Two microbatches per rank; microbatch 0 holds 1+3 tokens, microbatch 1 holds 6+2, N = 12. "
        "b = 2·S/(2·N_m) gives microbatch-0 tokens e = 1/8 and microbatch-1 tokens e = 1/16: 2× apart, "
        "where both should weigh 1/12.",
    ),
    Code.WORLD_SIZE_MISMATCH: CodeDoc(
        Severity.ERROR,
        "uniform weights, off by an integer factor (W)",
        why="Every token weighs the same, but q = e·N is an integer k or 1/k. Typical causes: S/N into an average "
        "(q = 1/W: the gradient silently ÷W); W·S/N into a summing hook or FSDP with divide factor 1 (q = W); "
        "a hard-coded or stale W; the global world size used on a data-parallel subgroup under DP×TP "
        "(q = TP); N summed over replicated ranks (q = 1/TP).",
        fix="Take W from the process group that averages the gradients (dist.get_world_size(ddp_model.process_group)) "
        "and match the reduction: W·S/N for an average, S/N for a sum.",
        example="b_r = S_r/N (no W): after the average e = 1/(2·4) = 0.125 for every token, q = 0.5. The direction "
        "is right but the gradient is half its size: under SGD the step halves; under Adam(W) the step "
        "barely changes, but epsilon now weighs 2× more, gradient clipping thresholds and the logged "
        "grad norm are off by 2, and the balance against weight decay shifts.",
    ),
    Code.SCHEDULE_RESCALED: CodeDoc(
        Severity.ERROR,
        "a pipeline schedule divided an already normalized loss again",
        why="A torch.distributed.pipelining schedule with scale_grads=True (its default) divides every gradient by "
        "its M microbatches after the backwards of each step(), for a loss_fn that returns each microbatch's "
        "mean. A loss already divided by the update's N is then divided twice: every token weighs 1/(M·N). "
        "With gradient accumulation over k step() calls each call divides every gradient accumulated so far, "
        "so the first call's tokens weigh 1/(M^k·N) and the last call's 1/(M·N).",
        fix="Construct the schedule with scale_grads=False and let loss_fn return the microbatch's loss sum "
        "divided by the update's N (every microbatch of every step() call and every data-parallel rank), "
        "times W where the data-parallel reduction averages; with Recorder(..., schedule=schedule) tokaudit "
        "sees the schedule's division.",
        example="M = 2 microbatches, loss_fn returns 2·S_m/N (W·S/N): the schedule's scale_grads(2) leaves e = 1/(2N) for "
        "every token, q = 0.5. With two step() calls per update the first call's tokens get 1/(4N), the "
        "second's 1/(2N): 2× apart.",
    ),
    Code.SCALE_MISMATCH: CodeDoc(
        Severity.WARNING,
        "uniform weights, off by a constant",
        why="Every token weighs the same but q = e·N is neither 1 nor an integer factor: a rescale g or a divisor "
        "that does not belong (a short final accumulation window M'/M, an extra constant), or no "
        "normalization at all (b = S, q = N/D grows with the token count).",
        fix="Backpropagate W·S_r/N (average) or S_r/N (sum) and record any post-backward rescale as grad_scale.",
        example="b_r = S_r (a raw sum): e = 1/2 for every token, q = e·N = 2 at this step and a different value at "
        "every step with another N.",
    ),
    Code.UNDECLARED_TERM_WEIGHT: CodeDoc(
        Severity.WARNING,
        "a loss term other than the main one weighs every token q/N, one q a span of steps, and no weight declared",
        why="An auxiliary term (a second head, a multi-token-prediction head) often carries a coefficient chosen "
        "on purpose, L = ΣS/N + λ·ΣS_aux/N_aux, so its tokens weigh λ/N: uniform weights, one q = λ in every step. "
        "A factor missing from that term's loss (its W, say) looks the same, so the logs cannot tell which. Where "
        "every term is off by one same q, nothing is weighed apart: the whole loss is scaled, judged as one term.",
        fix="Where λ is chosen on purpose, declare it, `with rec.loss_term(name, weight=λ):`, and the term is "
        "judged against λ/N; else normalize the term as the main one (W·S/N into an average).",
        example="An MTP head added with λ = 0.3 to the main loss: each of its tokens weighs 0.3/N, q = 0.3 at every step.",
        undecidable=True,
    ),
    Code.TERM_WEIGHT_INCONSISTENT: CodeDoc(
        Severity.ERROR,
        "records of one step declare different weights λ for one loss term",
        why="A term's tokens are judged against the λ/N its records declare, each record against its own. Where "
        "the records of one update declare different λ, the term's tokens weigh λ/N by rank or microbatch: the "
        "objective is no λ·ΣS/N, whatever each record's weight reads. A warm-up or schedule counted per rank (a "
        "rank-local counter), or loss_term(name, weight=λ) said on some ranks or microbatches only, does this.",
        fix="Compute λ from the optimizer's global step, the same on every rank and microbatch of an update, and "
        "declare it on every record of the term: `with rec.loss_term(name, weight=λ):`.",
        example="An auxiliary head warmed up by a counter each rank keeps: at step 5 rank 0 declares λ = 0 and rank 1 "
        "λ = 0.5; rank 1's tokens weigh 0.5/N, rank 0's nothing.",
    ),
    Code.PADDED_DENOMINATOR: CodeDoc(
        Severity.ERROR,
        "the denominator counts padding or ignored labels",
        family="weighting",
        why="The per-token losses were averaged over all T positions (loss.mean() on a masked tensor): "
        "b = S/T. Sequences with more padding get smaller weights; with a global T, weights are uniform "
        "but q = N/ΣT < 1.",
        fix="Mask the per-token losses, sum them, and divide by the valid-token count N (labels != ignore_index), "
        "never by the number of positions.",
        example="Rank 0 has 1 valid token in 8 positions, rank 1 has 3 in 8: b_r = W·S_r/16 gives e = 1/16 "
        "everywhere, q = 4/16 = 0.25.",
    ),
    Code.UNEXPLAINED_WEIGHTING: CodeDoc(
        Severity.ERROR,
        "weights differ and no denominator explains them",
        family="weighting",
        why="Within one step the effective weights differ, and none of n, n_r, n·M, N_m, N, T or 1 makes "
        "α = e·Den constant. Often: different code paths on different ranks, a loss term added on some ranks "
        "only, or a per-sequence mean mixed with a token mean. One cause is named where the weights fit it: "
        "each microbatch's mean times a count of k labels more than it was over, the step divided by the sum of "
        "those counts, e = (n + k)/(n·(N + k·R)), as a count taken before the causal shift gives (torchtune's "
        "recipes count the labels before the shift); the evidence then holds `extra_labels_per_record`.",
        fix="Run `tokaudit weights PATH --step S` on the step named in the finding and compare b/S across records.",
        example="b0 = S0/1 but b1 = 2·S1/4: e0 = 0.5, e1 = 0.25, and no single denominator gives both.",
    ),
    Code.NONUNIFORM_IN_MICROBATCH: CodeDoc(
        Severity.WARNING,
        "valid tokens of one microbatch got different weights",
        why="The backward probe saw min ∂b/∂ℓᵢ ≠ max ∂b/∂ℓᵢ over the valid tokens of one record: a per-sequence "
        "or per-document mean, or explicit token weights.",
        fix="Legitimate when chosen on purpose. For the token-mean objective, sum per-token losses and divide "
        "once by N.",
        example="Rank 1 holds two sequences with 1 and 2 valid tokens and averages per sequence: its tokens get "
        "1/2 and 1/4 of its weight.",
        detail="an error, listed first, where the records' own mean weights also read as local means (a mean per "
        "sequence makes each record's mean 1/n): `local_mean` then follows as a warning",
    ),
    Code.MASKED_TOKENS_WEIGHTED: CodeDoc(
        Severity.WARNING,
        "positions that are not valid carry weight and their loss is not 0",
        why="The probe saw Σ|∂b/∂ℓᵢ| > 0 over positions that are not valid and whose loss ℓᵢ is not 0 (padding "
        "labelled as a real token, a mask applied after the loss): the loss was reduced over them, so they are "
        "trained. A masked position whose loss is an exact 0, as cross_entropy's ignore_index gives, passes no "
        "gradient and is not counted: per_token.sum() / N stays a token mean.",
        fix="Label them with `ignore_index`, or reduce over valid positions only: per_token[valid].sum() / N.",
        example="Rank 0 has 1 valid token in 8 positions and labels its padding as a real token (id 0, not -100), so "
        "the 7 padding positions have a loss that is not 0: W·per_token.sum()/N gives each of them "
        "∂b/∂ℓ = 2/4 = 0.5, as much as the valid token, and the padding is trained.",
        detail="a masked position whose loss is an exact 0, as `ignore_index` gives, passes no gradient and is not "
        "counted",
    ),
    Code.MISSING_RANK: CodeDoc(
        Severity.ERROR,
        "a rank has no record for a step others recorded",
        why="Records of a step come from fewer ranks than W. Either the rank skipped forward/backward (a desynchronized "
        "collective: DDP hangs or mixes steps) or it did not record, and its tokens are missing from the audit's N. "
        "Where every such step lacks only ranks whose recorders the training code closed earlier while the others went "
        "on (out of data under DDP's join(); W ≤ 64), its records weighing every token 1/N of the ranks still training, "
        "that is the token mean under join()'s default, not where it divides by the ranks still joined: a warning that "
        "the logs cannot tell. A term other than the main one, lacked where the main loss was recorded, its weights right: info.",
        fix="Every rank runs every microbatch's forward and backward, with a zero loss that stays connected to "
        "the graph when it has no valid token; record on every rank.",
        example="Rank 0 has no valid token and `continue`s past backward: rank 1's all-reduce waits for a partner "
        "that never comes (or pairs with the next step).",
    ),
    Code.UNEVEN_MICROBATCHES: CodeDoc(
        Severity.WARNING,
        "ranks ran different numbers of microbatches in one step, without synchronizing equally often",
        why="A backward that syncs all-reduces on every rank: a rank that syncs more often than another pairs with "
        "the wrong partner or waits alone. Different counts are fine when every rank syncs as often as every "
        "other, its last microbatch among them (usually once, the others under no_sync; a loss recorded by k layers "
        "leaves k records of that backward), and N counts every microbatch (the weights say so): the all-reduces "
        "pair off one for one, and a sum of all-reduced sums is the all-reduced sum. This is raised where the "
        "records show otherwise or do not record sync.",
        fix="Give every rank the same number of microbatches (pad with empty ones that still run backward), or run "
        "all but each rank's last under no_sync.",
        example="Rank 0 runs 2 microbatches, rank 1 runs 3, every one syncing: the third backward of rank 1 syncs "
        "with rank 0's next step.",
        severity_note="where no record says whether it synced, the logs cannot tell: alone, `inconclusive`",
    ),
    Code.UNEQUAL_SYNCS: CodeDoc(
        Severity.WARNING,
        "ranks of as many microbatches synchronized different numbers of times in one step",
        why="A backward that syncs all-reduces on every rank: where one rank syncs more often than another, its extra "
        "all-reduce pairs with the other's next one or waits alone (`uneven_microbatches` judges uneven counts).",
        fix="Run all but each rank's last microbatch under no_sync() on every rank alike (the same accumulation "
        "steps everywhere).",
        example="Two microbatches a rank: rank 0 runs both outside no_sync(), rank 1 only its last; rank 0's second "
        "all-reduce pairs with rank 1's first of the next step.",
    ),
    Code.WORLD_SIZE_INCONSISTENT: CodeDoc(
        Severity.ERROR,
        "ranks disagree on W within one step",
        why="Records of one step carry different world_size values: some rank computed W from another group "
        "or a constant.",
        fix="Derive W from the averaging process group on every rank.",
        example="Rank 0 records W = 2, rank 1 records W = 8.",
    ),
    Code.WORLD_SIZE_CHANGED: CodeDoc(
        Severity.INFO,
        "W differs between steps of one run",
        why="An elastic restart or a resume on a different number of GPUs. Fine when intended, if N and W were "
        "recomputed.",
        fix="Nothing, unless the findings around the change show a W mismatch.",
        example="Steps 0–999 ran on W = 8, steps 1000– on W = 4.",
    ),
    Code.DUPLICATE_RECORDS: CodeDoc(
        Severity.WARNING,
        "the same (run, group, step, micro, rank) appears more than once",
        why="A copy of records (a compacted or copied file beside the shards), a second launch under the same run "
        "id, a resume that replayed steps into the same folder, or a step that went back during a launch (each "
        "epoch's batch index given as the step: copies inside one file say so). One record of each key is kept, the "
        "later published (the recorder's shards say which launch wrote them and are numbered as written; of files that "
        "do not say, another writer's, the one modified last), and a rank's step two launches recorded is the later "
        "launch's alone, as is a step it recorded again on fewer ranks (a run resumed on fewer GPUs: the earlier "
        "launch's ranks past the later one's W are no part of it); the finding names the files and the likely cause. "
        "Copies are not evidence about the "
        "gradient: the verdict reads the records kept. Except where the records a later launch recorded again, "
        "judged alone, weigh their tokens wrong (a normalization's error): a launch that resumed from a checkpoint "
        "after them (its steps numbered from 0 again) kept what they trained, one that replayed them from an earlier "
        "checkpoint did not, and the logs cannot tell which, so the run is inconclusive. Where the files do not say "
        "which launch came first, a time a copy may have changed, the same holds the other way round: the kept "
        "records' errors over those steps cannot tell where the others weigh their tokens right. And where copies inside one file differ "
        "(microbatches logged under one index, loss terms without a term column, or a step given again): the later "
        "copies alone may hold part of an update's tokens, so a uniform factor over those steps cannot be told "
        "either.",
        fix="Leave copies out of the folder audited; give each launch its own run_id; resume from the "
        "checkpoint's step; give the recorder the optimizer's global step.",
        example="Steps 90–99 were recorded before a crash and again after resuming from step 90.",
    ),
    Code.EMPTY_UPDATE: CodeDoc(
        Severity.INFO,
        "no valid token in the whole update (N = 0)",
        why="With N = 0, b = S/N is 0/0. One policy must hold on every rank: clamp N to 1 (zero gradient) and "
        "skip optimizer.step() together. An error when a rank produced NaN or ranks disagree on skipping.",
        fix="Decide from the global N, which every rank knows after the same all-reduce.",
        example="Both ranks have n = 0: W·S/max(N, 1) = 0 on both, backward runs, the step is skipped on both.",
        severity_note="error when a record is non-finite or ranks disagree on `skipped`",
    ),
    Code.ZERO_TOKEN_NONFINITE: CodeDoc(
        Severity.ERROR,
        "a record with n = 0 has a non-finite backward scalar",
        why="The code divided by a zero count (S/n with n = 0, or S/N where N = 0: 0/0 = NaN). Whether the NaN "
        "reaches the gradient depends on the loss: cross-entropy's backward gives an ignored position an exact 0 "
        "whatever flows into it, while a masked mean written by hand passes the NaN to every position, and DDP's "
        "all-reduce then spreads it to every rank's gradient and the weights. The steps after it say which: weights "
        "once NaN stay NaN, and so does every later loss, in every loss term.",
        fix="Divide by the global N (clamped to 1), never by the local count.",
        example="Rank 0 has n0 = 0: b0 = 0/0 = NaN. With a hand-written mean, after the average every parameter's "
        "gradient is NaN and every loss of the next step too (an error); with cross-entropy the next step is finite "
        "(information).",
        severity_note="information where a later loss is finite or the update was skipped (the NaN never reached "
        "the weights); a warning where the run ends first (the logs cannot tell, alone `inconclusive`)",
    ),
    Code.NONFINITE_VALUES: CodeDoc(
        Severity.ERROR,
        "NaN or infinity where n > 0",
        why="S, b or the probe's weights are not finite on a record with valid tokens.",
        fix="Find the first non-finite loss (torch.autograd.set_detect_anomaly), check the loss scale and the "
        "denominator.",
        example="S0 = inf from an fp16 overflow: the step's reduced gradient is inf.",
    ),
    Code.REPORTED_LOSS_MISMATCH: CodeDoc(
        Severity.WARNING,
        "the reported loss is not ΣS/N",
        family="reporting",
        why="The logged loss differs from the token mean of the step: often the mean of per-rank means "
        "(Lightning sync_dist, rank-0 logging of a local mean) or ×GAS. Losses rounded to a few decimals are compared "
        "within half their last decimal, and losses that are all exact in a half precision (a float16 or bfloat16 "
        "tensor's values) within half its last place. Of several loss terms, ΣS/N is the main term's, or the sum of "
        "the terms' token means; where the records cannot tell the main term from another (two heads on every "
        "microbatch), a logged loss that is either one's is none.",
        fix="Report all_reduce(ΣS)/all_reduce(Σn) from detached sums and counts.",
        example="S0 = 3 (n0 = 1), S1 = 3 (n1 = 3): ΣS/N = 6/4 = 1.5, the mean of local means is (3 + 1)/2 = 2.",
    ),
    Code.REPORTED_LOSS_SHIFTED: CodeDoc(
        Severity.INFO,
        "the reported loss is ΣS/N, stamped one update off",
        family="reporting",
        why="Each logged loss that differs from its step's token mean is the token mean of the step beside it: "
        "the losses are right but recorded with the update before or after their own, as when "
        "rec.report_loss() is given the loss of an update that has not closed yet, or a trainer's step "
        "counter is one off the optimizer's.",
        fix="Give the step the loss belongs to: `rec.report_loss(value, step=...)`.",
        example="Step 0: ΣS/N = (S0 + S1)/4 = 1.5; step 1, on other tokens: 2.0; step 2: 1.8. The log holds 2.0 for "
        "step 0 and 1.8 for step 1: each is the next step's token mean, reported before the update closed.",
        detail="every step that differs carries the next (or previous) step's token mean",
    ),
    Code.MISSING_SYNC: CodeDoc(
        Severity.ERROR,
        "the last microbatch did not synchronize",
        why="Under gradient accumulation every microbatch but the last runs in no_sync(); here the last did "
        "too (or its forward went through model.module, which DDP's reducer never sees), so the optimizer stepped "
        "on local gradients and ranks drift apart. Where such an update was "
        "closed as skipped (zero_grad() before its last microbatch, no optimizer step), zero_grad() ran inside "
        "the accumulation window: the microbatches before it were discarded.",
        fix="Run the last microbatch outside model.no_sync(), its forward through the DDP model (not model.module); "
        "call optimizer.zero_grad() once per update, after "
        "optimizer.step(), never between its microbatches.",
        example="Both microbatches of rank 0 ran in no_sync(): rank 0's parameters now differ from rank 1's.",
        severity_note="information where every such update was closed skipped (gradients cleared, no step): nothing of "
        "it reached the weights, and what its discarded microbatches cost the next update its weights show",
    ),
    Code.SYNC_EVERY_MICRO: CodeDoc(
        Severity.INFO,
        "every microbatch synchronized",
        why="Correct gradients, but each of the M microbatches all-reduced: M× the communication.",
        fix="Wrap all but the last microbatch in model.no_sync().",
        example="M = 4: four all-reduces per step where one is enough.",
    ),
    Code.BALANCED_COUNTS: CodeDoc(
        Severity.INFO,
        "counts are equal everywhere: local and global means coincide",
        why="With n equal on every record, S_r/n_r·(1/W) = S_r/N, so a local mean and the token mean give the "
        "same weights and the logs cannot show which one the code uses.",
        fix="Audit a run with uneven counts (real padding, ignored labels, packing).",
        example="n0 = n1 = 2: b_r = S_r/2 (a local mean) and 2·S_r/4 (the token mean) are the same number.",
    ),
    Code.LOSS_SCALE: CodeDoc(
        Severity.WARNING,
        "uniform weights with a power-of-two factor: an unrecorded loss scale",
        why="Mixed precision multiplies the loss by a scale S_amp (GradScaler: 2^16 at the start, halved at "
        "every overflow) before backward and divides it out of the gradients before the optimizer step. The "
        "probe measures ∂(S_amp·b)/∂ℓ, so without the scaler every token shows q = S_amp·q_true: a large "
        "power of two that W does not explain. The true scale cannot be read, so the run is inconclusive, "
        "not incorrect.",
        fix="Pass the scaler: Recorder(..., scaler=scaler). Its scale is then divided out (g = 1/S_amp) and the "
        "updates it skips are marked. The Hugging Face and Lightning callbacks find the trainer's scaler.",
        example="W·S_r/N under a GradScaler at 65536: the probe sees e = 65536·0.25 for every token, q = 65536 = 2^16.",
        undecidable=True,
    ),
    Code.UNKNOWN_DIVISOR: CodeDoc(
        Severity.WARNING,
        "the gradient reduction's divisor could not be seen",
        why="A DDP comm hook the recorder does not know (or a model it was not given) may average (D = W) or sum "
        "(D = 1). The same backward scalar is then right or W× off, so tokaudit does not judge the absolute "
        "scale: local means and per-microbatch denominators are still found, since they show in the weights' "
        "ratios whatever D is.",
        fix="Tell the recorder: Recorder(..., grad_divisor=1) for a summing hook, grad_divisor=W for an average; "
        "or pass the DDP-wrapped model as model=.",
        example="A custom hook all-reduces with SUM: W·S_r/N = 2·S_r/4 gives e = 0.5 per token (q = 2, wrong) while "
        "the log, assuming an average, shows q = 1.",
        undecidable=True,
    ),
    Code.NO_WEIGHTS: CodeDoc(
        Severity.WARNING,
        "valid records carry no usable weight",
        why="A weight needs the backward scalar b with a non-zero loss sum S (c = b/S) or the probe's measurement. "
        "Records with neither cannot be judged; a step made only of them is not called correct.",
        fix="Pass backward_scalar= with every record, or wrap the per-token loss in rec.probe().",
        example="Rank 1 records S = 0 (every token predicted perfectly) with b = 0 and no probe: c = 0/0 is unknown.",
        undecidable=True,
    ),
    Code.RECORDS_DROPPED: CodeDoc(
        Severity.WARNING,
        "the recorder could not write some records",
        why="A write failed (a full or read-only disk) and the records could not be kept until a later write. The "
        "recorder notes which steps lost records; those steps are left out of the audit instead of being "
        "judged on part of their tokens.",
        fix="Give the log folder room, and check the training's warnings for the recorder's write errors.",
        example="The disk filled during steps 120–131: those steps are listed and not judged.",
        undecidable=True,
    ),
    Code.COUNT_MISMATCH: CodeDoc(
        Severity.WARNING,
        "a recorded count disagrees with the tokens the probe saw",
        why="A record's mean probed weight c = Σ∂b/∂ℓᵢ / n is the mean of its valid tokens' weights only when n is "
        "the number of tokens the probe saw, and then lies between the lightest and the heaviest of them. "
        "Outside that range, valid_tokens counts another mask (attention_mask.sum() where the loss ignores "
        "labels of -100, padding included, another microbatch's count). N and every weight derived from the "
        "counts would be wrong, so those steps are left out instead of being judged on them, and the run is "
        "inconclusive, not incorrect: the training may well be right.",
        fix="Record valid_tokens from the mask the loss and rec.probe use (labels != ignore_index), summed over the "
        "same microbatch.",
        example="Rank 0 has 3 labelled tokens among 10 attended ones and records n = 10: the probe sees 3 tokens of "
        "weight 2/N each, Σ∂b/∂ℓ = 6/N, and 6/N / 10 = 0.6/N lies below 2/N.",
        detail="a record's probed weight sum over its valid_tokens lies outside the probe's lightest and heaviest "
        "token; those steps are left out",
        undecidable=True,
    ),
    Code.RANKS_NOT_RECORDED: CodeDoc(
        Severity.WARNING,
        "some ranks below W have no record in any step: the files given hold part of the run",
        why="N is the valid tokens of every rank, and each weight is judged against it: with a rank's files left "
        "out (one rank's file given alone), or a recorder made on rank 0 only, every step's N is partial, so "
        "neither the weights' scale nor a local mean can be told. Nothing about the normalization is judged. Where "
        "other runs of the audit hold the missing ranks of the same W over the same steps, the finding names them "
        "(`runs_with_other_ranks`): a run id made on each rank (a time stamp, a tracker's run id, the rank in it) "
        "splits one run into runs of a few ranks each.",
        fix="Give the whole run's folder (every rank's shards), and make the Recorder on every rank, with the same "
        "run_id on every rank.",
        example="`tokaudit check runs/exp/rank-00000-000000.parquet` of a W=2 run: 1 of 2 ranks' records. Or "
        '`run_id=f"exp-{time.time():.0f}"` on each rank of a W=2 run: runs exp-1733000000 (rank 0) and exp-1733000001 '
        "(rank 1).",
        undecidable=True,
    ),
    Code.UNREADABLE_FILES: CodeDoc(
        Severity.WARNING,
        "files in the run's folder could not be read: what they hold is not audited, and the run is not called correct",
        why="A damaged file (truncated by a full disk or a copy cut short, or not Parquet) is named on its own line "
        "and the rest of the log is audited. The records it held may be any rank's at any step: a step that lacks "
        "a rank's records may have them there, so the gap is not a training bug (`missing_rank` says the logs "
        "cannot tell), and a step judged without them may have had more tokens in its N. Nothing read says the run "
        "is right where part of it could not be read.",
        fix="Restore or repair the file (the line that names it says what is wrong with it), or move it out of the "
        "run's folder to audit what is left as it is.",
        example="Rank 1 of a W=2 run writes a shard a step; the shard of step 1 is cut to 200 bytes by a failed copy: "
        "step 1 lacks rank 1, said as the file's, and the run is `inconclusive`, not `incorrect`.",
        undecidable=True,
    ),
    Code.UPDATE_ENDS_GUESSED: CodeDoc(
        Severity.WARNING,
        "the recorder was told no update's end: it took each backward for one, so N may be a microbatch's",
        why="Without optimizer=, begin_step() or step=, the recorder ends an update at each backward that "
        "synchronized gradients (every backward where no DDP model says): where no backward of an update ran under "
        "no_sync(), that update may be one microbatch of an accumulation that synchronized each time. Under "
        "gradient accumulation an update is several backwards: a correct token mean then reads as uniform weights "
        "N_micro/N of the token mean's, and a per-microbatch mean on one rank reads as the token mean. The logs "
        "cannot tell which, so the run is not called correct, and a uniform factor is not called a mistake.",
        fix="Give the Recorder the optimizer (optimizer=), or call begin_step() at each update, or pass step= to "
        "record(); a DDP model given as model= says which backward synchronized.",
        example="One process, 4 microbatches an update, b = S/N with N over the 4: each backward recorded as an "
        "update holds N_micro = N/4 on average, q = 1/4 or so, uniform.",
        undecidable=True,
    ),
    Code.TERMS_ONE_OBJECTIVE: CodeDoc(
        Severity.INFO,
        "several loss terms together weigh every valid token 1/N over their combined tokens: judged as one",
        why='A loss computed in pieces (the chunks of a sequence\'s cross-entropy, each `reduction="sum"` and '
        "divided by the whole microbatch's N) and recorded as one term a piece: each piece weighs its tokens "
        "1/N, so alone it reads as a scale of its share N_t/N, while together the pieces are the token mean "
        "over their combined tokens, which is what was trained. Such terms are judged as one objective. Two "
        "real heads on the same tokens (multi-token prediction, an auxiliary loss) each weigh their tokens "
        "1/N_t: together q = 2, so they are audited apart, each as its own token mean.",
        fix="Nothing to change in training. To audit the pieces as one term, record them under one term (the "
        "recorder merges the chunks of a captured cross-entropy itself).",
        example="One microbatch of N = 8 valid tokens in two chunks of 3 and 5, each backpropagating W·S_k/8 with "
        "W = 2 (D = 2): every token weighs e = 1/8; term 0 alone reads q = 3/8, term 1 q = 5/8, together "
        "e·ΣN = 1.",
        detail="at every step each term's tokens weigh the same e and e·ΣN over the terms is 1",
    ),
    Code.UNFINISHED_UPDATE: CodeDoc(
        Severity.INFO,
        "the run stopped inside an update, or before each rank's last records were written: those steps are not judged",
        why="A job stopped by SIGTERM (preemption, a time limit) or an error between two microbatches leaves the "
        "records of an update never applied, and only some of its microbatches; the recorder, which watches the "
        "optimizer, says so in the footers. A rank killed at once (the OOM killer, a lost node) loses what its "
        "recorder held since its last shard, so the ranks' records end at different steps; killed inside an update "
        "after a flush, every rank's last update holds fewer microbatches than the updates before it, none of them "
        "synchronized. Either way N over those "
        "steps is not the update's and its weights would read as wrong: the audit leaves them out. A rank short by "
        "more than its widest shard, or closed by the training code (out of data under join()), is `missing_rank`; "
        "in shards of several ranks each (a compaction's) no footer says which.",
        fix="Nothing where the run was stopped. Where a loader ends inside an update, let the trainer step it. A run "
        "still training: `tokaudit check --live`.",
        severity_note="warning where the shards hold several ranks each, and for a last update cut short after a flush "
        "(a loop that flushed and then stepped it unsynchronized leaves the same records): the logs cannot tell, alone "
        "`inconclusive`",
        example="SIGTERM between the two microbatches of update 5: steps 0–4 are judged, step 5 is said here. Rank 1 "
        "killed with its shards written through step 3, rank 0's through 5: steps 4–5 are said here.",
    ),
    Code.SKIP_MISMATCH: CodeDoc(
        Severity.ERROR,
        "ranks disagree on skipping an update that has valid tokens",
        why="An optimizer step one rank takes and another skips leaves the replicas' weights apart from then on, "
        "and DDP never compares them again. A GradScaler decides from gradients every rank holds after the same "
        "all-reduce, so all ranks skip together; a guard on a rank's own loss (a NaN check) does not.",
        fix="Decide whether to skip from what every rank shares: the all-reduced gradients, or a flag all-reduced.",
        example="At step 7 rank 0's own loss is NaN and it skips optimizer.step() while rank 1 steps: from step 8 "
        "the two ranks train different weights.",
    ),
}
"""Every Code, in the Code enum's order (tests check both)."""

DEFAULT_SEVERITY: dict[Code, Severity] = {code: doc.severity for code, doc in CODE_DOCS.items()}

UNDECIDABLE: frozenset[Code] = frozenset(code for code, doc in CODE_DOCS.items() if doc.undecidable)
"""Warnings that say the logs cannot tell: alone, they make a run `inconclusive`, not `incorrect`."""


REPORTING: frozenset[Code] = frozenset(code for code, doc in CODE_DOCS.items() if doc.family == "reporting")
"""Findings about the logged loss, not the gradient: they never decide the verdict, which asks whether every
valid token got the token-mean weight; the run's `reporting` status says them beside it."""

WEIGHTING: frozenset[Code] = frozenset(code for code, doc in CODE_DOCS.items() if doc.family == "weighting")
"""Findings that the tokens of a step weighed differently: --min-ratio reads their `weight_ratio`."""

TOKEN_MEAN_FIXES: frozenset[Code] = frozenset(
    {
        Code.LOCAL_MEAN,
        Code.PER_MICRO_DENOMINATOR,
        Code.WORLD_SIZE_MISMATCH,
        Code.SCALE_MISMATCH,
        Code.PADDED_DENOMINATOR,
        Code.UNEXPLAINED_WEIGHTING,
    }
)
"""Findings whose fix is the token mean itself: they carry its code for the run's set-up (`tokaudit._recipes`)."""
