"""One explicit pyarrow schema per catalog relation, used by every writer, reader and test.

``models`` has fixed columns plus one typed column per metadata field (numbers as float64,
booleans as bool, text as string, one type per column for the whole catalog: see
graphstore.column_types); ``metadata_json`` keeps them all verbatim.
"""
from __future__ import annotations

import pyarrow as pa

MODEL_CORE = pa.schema([
    ("model_id", pa.string()),
    ("zoo", pa.string()),
    ("source_path", pa.string()),
    ("checkpoint", pa.string()),
    ("architecture_id", pa.string()),
    ("num_params", pa.int64()),
    ("num_nodes", pa.int64()),
    ("num_edges", pa.int64()),
    ("kernel_h", pa.int32()),
    ("kernel_w", pa.int32()),
    ("buffers_json", pa.string()),
    ("metadata_json", pa.string()),
    ("ingested_at", pa.timestamp("us", tz="UTC")),
])

ARCHITECTURES = pa.schema([
    ("architecture_id", pa.string()),
    ("num_layers", pa.int32()),          # neuron layers
    ("num_ops", pa.int32()),
    ("num_nodes", pa.int64()),
    ("num_edges", pa.int64()),
    ("num_params", pa.int64()),
    ("kernel_h", pa.int32()),
    ("kernel_w", pa.int32()),
    ("input_shape", pa.list_(pa.int64())),
    ("summary", pa.string()),            # e.g. "conv(1->8,3x3) norm relu | ... "
    ("plan_json", pa.string()),
    ("spec_json", pa.string()),
    ("program_json", pa.string()),       # a torch.export program kept to rebuild the network (no spec)
    ("program_tensors", pa.binary()),    # its tensors that are not state (safetensors), or null
])

LAYERS = pa.schema([
    ("model_id", pa.string()),
    ("layer", pa.int32()),               # operation index; edges.layer points here
    ("kind", pa.string()),               # linear | conv | batch_norm | layer_norm | residual | embedding
    ("relation", pa.string()),
    ("src_layer", pa.int32()),           # neuron layers (nodes.layer)
    ("dst_layer", pa.int32()),
    ("in_size", pa.int64()),
    ("out_size", pa.int64()),
    ("weight_shape", pa.list_(pa.int64())),
    ("kernel_h", pa.int32()),
    ("kernel_w", pa.int32()),
    ("groups", pa.int32()),
    ("activation", pa.string()),         # activation applied to the destination neurons
    ("path", pa.string()),
    ("weight_key", pa.string()),
])

NODES = pa.schema([
    ("model_id", pa.string()),
    ("node", pa.int64()),
    ("node_type", pa.dictionary(pa.int8(), pa.string())),
    ("layer", pa.int32()),
    ("position", pa.int32()),
    ("bias", pa.float32()),
    ("activation", pa.dictionary(pa.int8(), pa.string())),
    ("running_mean", pa.float32()),
    ("running_var", pa.float32()),
])

EDGES = pa.schema([
    ("model_id", pa.string()),
    ("src", pa.int64()),
    ("dst", pa.int64()),
    ("relation", pa.dictionary(pa.int8(), pa.string())),
    ("layer", pa.int32()),
    ("weight", pa.list_(pa.float32())),  # kernel centred in the model's (kernel_h, kernel_w) frame
])

INGEST_ERRORS = pa.schema([
    ("source_path", pa.string()),
    ("zoo", pa.string()),
    ("error_type", pa.string()),
    ("message", pa.string()),
    ("failed_at", pa.timestamp("us", tz="UTC")),
])

RUNS = pa.schema([
    ("run_id", pa.string()),
    ("task", pa.string()),               # regression | classification
    ("target", pa.string()),
    ("where_sql", pa.string()),
    ("config_json", pa.string()),
    ("metrics_json", pa.string()),
    ("model_path", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
    ("method", pa.string()),             # the predictor whose predictions are the run's answer (null: none)
])

PREDICTIONS = pa.schema([
    ("run_id", pa.string()),
    ("model_id", pa.string()),
    ("split", pa.string()),
    ("target", pa.string()),
    ("predicted", pa.float64()),
    ("predicted_label", pa.string()),
    ("method", pa.string()),             # a jobs.predictors name, or a blend of them (ngnn+statnn+...+probegen)
    ("in_distribution", pa.bool_()),     # jobs predict: the input's weight scales lie within the training models'
])

EMBEDDINGS = pa.schema([
    ("run_id", pa.string()),
    ("model_id", pa.string()),
    ("vector", pa.list_(pa.float32())),
])

SIMILAR = pa.schema([
    ("run_id", pa.string()),
    ("query_id", pa.string()),
    ("neighbour_id", pa.string()),
    ("rank", pa.int32()),
    ("score", pa.float64()),
])

LAYER_EQUIVARIANCE = pa.schema([       # jobs layer-equivariance: one row per model, transform and layer
    ("analysis_id", pa.string()),
    ("model_id", pa.string()),
    ("transform", pa.string()),          # mirror-lr | mirror-ud | perm-input[:SEED]
    ("layer", pa.int32()),               # 1-based: f_1 = first hidden layer after its activation; last = output
    ("width", pa.int32()),
    ("activation", pa.string()),         # the layer's activation (null: linear output)
    ("samples", pa.int64()),             # noise inputs (half fit A, a quarter picks the ridge, a quarter tests)
    ("seed", pa.int64()),
    ("noise_std", pa.float64()),         # noise inputs y ~ N(0, noise_std^2) per entry
    ("error", pa.float64()),             # median test |f(gy) - A f(y)| / |f(y)|, A the ridge fit
    ("identity_error", pa.float64()),    # the same with A = I
    ("signed_perm_error", pa.float64()), # the same with A = the best signed permutation (least squares)
    ("perm_error", pa.float64()),        # the same with A = the best permutation
    ("signed_perm_neurons", pa.float64()),    # share of neurons that signed permutation maps within 10% of their image
    ("perm_neurons", pa.float64()),           # ... that permutation
    ("signed_perm_rel_dist", pa.float64()),   # min ||A - c P||_F / ||A||_F over scales c, signed permutations P
    ("perm_rel_dist", pa.float64()),          # ... over permutations
    ("signed_perm_share", pa.float64()), # median over rows of A's squared mass on the nearest P's entry
    ("ridge", pa.float64()),             # ridge of the fit, relative to the mean eigenvalue of f^T f
    ("condition", pa.float64()),         # condition number of f on the fit samples
    ("match_corr", pa.float64()),        # median |corr(f_pi(j)(gy), f_j(y))|, best signed neuron matching pi
    ("match_negations", pa.int32()),     # neurons pi maps onto a negated neuron
    ("matrix", pa.list_(pa.float32())),  # A, row-major width x width
    ("signed_perm", pa.list_(pa.int32())),    # best signed permutation: column of each row ...
    ("signs", pa.list_(pa.int8())),           # ... and its sign
    ("created_at", pa.timestamp("us", tz="UTC")),
])

INGEST_RELATIONS = ("models", "architectures", "layers", "nodes", "edges", "ingest_errors")
RESULT_RELATIONS = ("runs", "predictions", "embeddings", "similarities", "layer_equivariance")
FIXED_SCHEMAS = {"architectures": ARCHITECTURES, "layers": LAYERS, "nodes": NODES, "edges": EDGES,
                 "ingest_errors": INGEST_ERRORS, "runs": RUNS, "predictions": PREDICTIONS,
                 "embeddings": EMBEDDINGS, "similarities": SIMILAR, "layer_equivariance": LAYER_EQUIVARIANCE,
                 "models": MODEL_CORE}
