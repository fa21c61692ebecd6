/* What Python reads back from the library at load (pagedllm/native/bindings.py): the shared
 * constants by name and the layout of every struct it passes, so its ctypes mirrors are checked
 * against the compiler's own sizeof / offsetof instead of being trusted to match by hand.
 * Keep FIELDS complete: a field added to a struct but not listed here is still caught through
 * sizeof, but only because neither struct has padding it could fill.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "pagedllm_native.h"

typedef struct {
    const char *name;
    int64_t value;
} Constant;

static const Constant CONSTANTS[] = {
    {"ABI_VERSION", PN_ABI_VERSION},
    {"MAX_DECODE_TOKENS", LD_MAX_TOKENS},
    {"MAX_PANEL_DECODE_TOKENS", LD_PANEL_MAX_TOKENS},
    {"HAS_AVX2", PN_AVX2},
    {"DTYPE_F32", PN_DTYPE_F32},
    {"DTYPE_F16", PN_DTYPE_F16},
    {"DTYPE_BF16", PN_DTYPE_BF16},
    {"DTYPE_FP8_E4M3", PN_DTYPE_FP8_E4M3},
    {"DTYPE_FP8_E5M2", PN_DTYPE_FP8_E5M2},
    {"OK", PN_OK},
    {"ERR_ARG", PN_ERR_ARG},
    {"ERR_NOMEM", PN_ERR_NOMEM},
    {"ERR_META", PN_ERR_META},
    {"MOE_GATE_PANEL", MOE_GATE_PANEL},
    {"MOE_DOWN_PANEL", MOE_DOWN_PANEL},
    {"QG_PANEL", QG_PANEL},
    {"DG_PANEL", DG_PANEL},
    {"DG_ROWS", DG_ROWS},
    {"FP8_E4M3_MAX", PN_FP8_E4M3_MAX},
};

typedef struct {
    const char *type, *field;
    int64_t offset, size;
} Field;

#define FIELD(T, F) {#T, #F, (int64_t)offsetof(T, F), (int64_t)sizeof(((T *)0)->F)}

static const Field FIELDS[] = {
    FIELD(LdModel, num_layers), FIELD(LdModel, hidden), FIELD(LdModel, num_heads),
    FIELD(LdModel, num_kv_heads), FIELD(LdModel, head_dim), FIELD(LdModel, intermediate),
    FIELD(LdModel, block_size), FIELD(LdModel, cache_dtype), FIELD(LdModel, quant_bits),
    FIELD(LdModel, fp8_act), FIELD(LdModel, bf16), FIELD(LdModel, panel_min), FIELD(LdModel, num_blocks),
    FIELD(LdModel, qkv_group),
    FIELD(LdModel, o_group), FIELD(LdModel, gate_up_group), FIELD(LdModel, down_group),
    FIELD(LdModel, vocab_size), FIELD(LdModel, max_position), FIELD(LdModel, eps),
    FIELD(LdModel, scale), FIELD(LdModel, embed), FIELD(LdModel, final_norm),
    FIELD(LdModel, cos), FIELD(LdModel, sin), FIELD(LdModel, input_norm),
    FIELD(LdModel, post_norm), FIELD(LdModel, qkv_w), FIELD(LdModel, o_w),
    FIELD(LdModel, gate_up_w), FIELD(LdModel, down_w), FIELD(LdModel, qkv_s),
    FIELD(LdModel, o_s), FIELD(LdModel, gate_up_s), FIELD(LdModel, down_s),
    FIELD(LdModel, qkv_b), FIELD(LdModel, o_b), FIELD(LdModel, gate_up_b),
    FIELD(LdModel, down_b), FIELD(LdModel, qkv_z), FIELD(LdModel, o_z), FIELD(LdModel, gate_up_z),
    FIELD(LdModel, down_z), FIELD(LdModel, qkv_p), FIELD(LdModel, o_p), FIELD(LdModel, gate_up_p),
    FIELD(LdModel, down_p), FIELD(LdModel, qkv_ps), FIELD(LdModel, o_ps), FIELD(LdModel, gate_up_ps),
    FIELD(LdModel, down_ps), FIELD(LdModel, qkv_pz), FIELD(LdModel, o_pz), FIELD(LdModel, gate_up_pz),
    FIELD(LdModel, down_pz), FIELD(LdModel, lora_slots), FIELD(LdModel, qkv_lora_rank),
    FIELD(LdModel, o_lora_rank), FIELD(LdModel, gate_up_lora_rank), FIELD(LdModel, down_lora_rank),
    FIELD(LdModel, qkv_la), FIELD(LdModel, o_la), FIELD(LdModel, gate_up_la), FIELD(LdModel, down_la),
    FIELD(LdModel, qkv_lb), FIELD(LdModel, o_lb), FIELD(LdModel, gate_up_lb), FIELD(LdModel, down_lb),
    FIELD(LdModel, q_norm), FIELD(LdModel, k_norm),
    FIELD(LdModel, key_cache), FIELD(LdModel, value_cache), FIELD(LdModel, window),

    FIELD(LdBatch, query_start_loc), FIELD(LdBatch, seq_lens), FIELD(LdBatch, block_tables),
    FIELD(LdBatch, slot_mapping), FIELD(LdBatch, positions), FIELD(LdBatch, input_ids),
    FIELD(LdBatch, num_reqs), FIELD(LdBatch, max_blocks), FIELD(LdBatch, bt_stride),
    FIELD(LdBatch, num_tokens), FIELD(LdBatch, parallel_work), FIELD(LdBatch, lora_rows),
    FIELD(LdBatch, lora_seg_slot), FIELD(LdBatch, lora_seg_start), FIELD(LdBatch, lora_num_segs),
};

typedef struct {
    const char *type;
    int64_t size;
} Struct;

static const Struct STRUCTS[] = {{"LdModel", sizeof(LdModel)}, {"LdBatch", sizeof(LdBatch)}};

#define COUNT(a) ((int64_t)(sizeof(a) / sizeof((a)[0])))

int pn_constant(const char *name, int64_t *value) {
    for (int64_t i = 0; i < COUNT(CONSTANTS); i++)
        if (strcmp(CONSTANTS[i].name, name) == 0) {
            *value = CONSTANTS[i].value;
            return PN_OK;
        }
    return PN_ERR_ARG;
}

int pn_struct_layout(const char *type, int64_t *size, int64_t *num_fields) {
    for (int64_t i = 0; i < COUNT(STRUCTS); i++)
        if (strcmp(STRUCTS[i].type, type) == 0) {
            *size = STRUCTS[i].size;
            *num_fields = 0;
            for (int64_t f = 0; f < COUNT(FIELDS); f++) *num_fields += strcmp(FIELDS[f].type, type) == 0;
            return PN_OK;
        }
    return PN_ERR_ARG;
}

int pn_field_layout(const char *type, const char *field, int64_t *offset, int64_t *size) {
    for (int64_t i = 0; i < COUNT(FIELDS); i++)
        if (strcmp(FIELDS[i].type, type) == 0 && strcmp(FIELDS[i].field, field) == 0) {
            *offset = FIELDS[i].offset;
            *size = FIELDS[i].size;
            return PN_OK;
        }
    return PN_ERR_ARG;
}
