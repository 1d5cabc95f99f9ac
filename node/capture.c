/*
 * Graph-tensor capture (and input injection) for llama.cpp's cb_eval hook.
 *
 * llama.cpp calls the scheduler's eval callback for every graph node, twice
 * for the nodes it observes: once with ask=true ("do you want this one?") and,
 * if we said yes, again with ask=false once the node is computed and before
 * any node that reads it runs. A Python ctypes callback costs 2-3 us per call,
 * about 500 calls per step for a 15-layer stage: 10-15 % of a decode step on
 * a small model. This C version costs a string compare or two per node.
 *
 * Capture: it copies the named tensor (the pre-norm residual stream after the
 * stage's last layer, "l_out-<n-1>") into a caller-owned float buffer,
 * appending: one llama_decode may run several ubatches and the callback fires
 * once per ubatch. Rows arrive in ubatch order; the Python side maps them back
 * to batch order and checks the row count of every ubatch recorded here.
 *
 * Injection: for graphs that transform any input embedding before the first
 * layer (Gemma and Gemma 2 multiply it by sqrt(n_embd), which float32 cannot
 * undo exactly), it overwrites the named node ("inp_scaled") with the caller's
 * rows -- the exact hidden state the previous stage produced -- consumed in
 * ubatch order from a caller-owned buffer.
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "ggml.h"
#include "ggml-backend.h"

#define SWARM_CAPTURE_MAX_UBATCHES 1024

enum {
    SWARM_CAPTURE_OK = 0,
    SWARM_CAPTURE_NOT_F32 = 1,
    SWARM_CAPTURE_NOT_CONTIGUOUS = 2,
    SWARM_CAPTURE_OVERFLOW = 3,
    SWARM_CAPTURE_WIDTH = 4,
    SWARM_CAPTURE_TOO_MANY_UBATCHES = 5,
    SWARM_CAPTURE_INJECT_UNDERFLOW = 6,
};

typedef struct swarm_capture {
    char name[64];         /* graph tensor name to capture ("" = none) */
    float *buf;            /* caller-owned destination */
    int64_t capacity;      /* floats available in buf */
    int64_t used;          /* floats written so far */
    int64_t width;         /* expected ne[0] (n_embd) */
    int32_t n_ubatches;    /* captures since the last reset */
    int32_t error;         /* first error seen, SWARM_CAPTURE_* */
    int32_t rows[SWARM_CAPTURE_MAX_UBATCHES];
    char inject_name[64];  /* graph tensor name to overwrite ("" = none) */
    const float *inject_buf;   /* caller-owned source, rows in ubatch order */
    int64_t inject_capacity;   /* floats available in inject_buf */
    int64_t inject_used;       /* floats consumed so far */
    int32_t n_injected;        /* injections since the last reset */
    int32_t inject_pad;
    int32_t inject_rows[SWARM_CAPTURE_MAX_UBATCHES];
} swarm_capture;

size_t swarm_capture_sizeof(void) { return sizeof(swarm_capture); }

void swarm_capture_reset(swarm_capture *c) {
    c->used = 0;
    c->n_ubatches = 0;
    c->error = SWARM_CAPTURE_OK;
    c->inject_used = 0;
    c->n_injected = 0;
}

static int check_tensor(const swarm_capture *c, const struct ggml_tensor *t) {
    if (t->type != GGML_TYPE_F32) {
        return SWARM_CAPTURE_NOT_F32;
    }
    if (!ggml_is_contiguous(t)) {
        return SWARM_CAPTURE_NOT_CONTIGUOUS;
    }
    if (t->ne[0] != c->width) {
        return SWARM_CAPTURE_WIDTH;
    }
    return SWARM_CAPTURE_OK;
}

bool swarm_capture_cb(struct ggml_tensor *t, bool ask, void *user_data) {
    swarm_capture *c = (swarm_capture *) user_data;
    const bool capture = c->name[0] != '\0' && strcmp(t->name, c->name) == 0;
    const bool inject = !capture && c->inject_name[0] != '\0' && strcmp(t->name, c->inject_name) == 0;
    if (!capture && !inject) {
        /* not ours: do not observe it, and never stop the graph */
        return ask ? false : true;
    }
    if (ask) {
        return true;
    }
    if (c->error != SWARM_CAPTURE_OK) {
        return true;
    }
    const int err = check_tensor(c, t);
    if (err != SWARM_CAPTURE_OK) {
        c->error = err;
        return true;
    }
    const int64_t n = ggml_nelements(t);
    if (inject) {
        if (c->inject_used + n > c->inject_capacity) {
            c->error = SWARM_CAPTURE_INJECT_UNDERFLOW;
            return true;
        }
        if (c->n_injected >= SWARM_CAPTURE_MAX_UBATCHES) {
            c->error = SWARM_CAPTURE_TOO_MANY_UBATCHES;
            return true;
        }
        ggml_backend_tensor_set(t, c->inject_buf + c->inject_used, 0, ggml_nbytes(t));
        c->inject_used += n;
        c->inject_rows[c->n_injected++] = (int32_t) (n / c->width);
        return true;
    }
    if (c->used + n > c->capacity) {
        c->error = SWARM_CAPTURE_OVERFLOW;
        return true;
    }
    if (c->n_ubatches >= SWARM_CAPTURE_MAX_UBATCHES) {
        c->error = SWARM_CAPTURE_TOO_MANY_UBATCHES;
        return true;
    }
    ggml_backend_tensor_get(t, c->buf + c->used, 0, ggml_nbytes(t));
    c->used += n;
    c->rows[c->n_ubatches++] = (int32_t) (n / c->width);
    return true;
}
