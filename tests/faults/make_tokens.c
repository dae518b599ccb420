/* ringattn_faults_tokens OUT COUNT [KEY=VALUE...]: writes an HDF5 token dataset in the layout of
 * train/token_dataset.hpp (/tokens, 1-D uint16, attributes vocab_size and tokenizer) with COUNT
 * tokens, or a broken variant of it for tests/faults/data.sh, which ringattn-data cannot write:
 *
 *   name=N       the dataset's name (default tokens)
 *   group=1      /N is a group, not a dataset
 *   type=T       uint16 (default), uint32, uint8, int32 or float32
 *   dims=2       shape [2, COUNT / 2] instead of [COUNT]
 *   vocab=V      attribute vocab_size (default 256); "none" leaves it out, "float" writes 256.0
 *   tokenizer=T  attribute tokenizer (default byte); "none" leaves it out, "int" writes 1
 *   bad=P:V      token V at position P (the others are below 64)
 *
 * Exit status 0 when the file is written, 1 otherwise (with a message).
 */
#include <hdf5.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(const char* what) {
  fprintf(stderr, "ringattn_faults_tokens: %s\n", what);
  return 1;
}

int main(int argc, char** argv) {
  const char *name = "tokens", *type_name = "uint16", *vocab = "256", *tokenizer = "byte";
  int group = 0, dims = 1;
  long long bad_position = -1, bad_value = 0;
  if (argc < 3) return fail("usage: ringattn_faults_tokens OUT COUNT [KEY=VALUE...]");
  const long long count = atoll(argv[2]);
  for (int i = 3; i < argc; ++i) {
    const char* value = strchr(argv[i], '=');
    if (value == NULL) return fail("expected KEY=VALUE");
    ++value;
    if (strncmp(argv[i], "name=", 5) == 0) {
      name = value;
    } else if (strncmp(argv[i], "group=", 6) == 0) {
      group = atoi(value);
    } else if (strncmp(argv[i], "type=", 5) == 0) {
      type_name = value;
    } else if (strncmp(argv[i], "dims=", 5) == 0) {
      dims = atoi(value);
    } else if (strncmp(argv[i], "vocab=", 6) == 0) {
      vocab = value;
    } else if (strncmp(argv[i], "tokenizer=", 10) == 0) {
      tokenizer = value;
    } else if (strncmp(argv[i], "bad=", 4) == 0) {
      if (sscanf(value, "%lld:%lld", &bad_position, &bad_value) != 2) return fail("bad=P:V");
    } else {
      return fail("unknown KEY");
    }
  }

  hid_t file_type = H5T_STD_U16LE;
  if (strcmp(type_name, "uint32") == 0)
    file_type = H5T_STD_U32LE;
  else if (strcmp(type_name, "uint8") == 0)
    file_type = H5T_STD_U8LE;
  else if (strcmp(type_name, "int32") == 0)
    file_type = H5T_STD_I32LE;
  else if (strcmp(type_name, "float32") == 0)
    file_type = H5T_IEEE_F32LE;
  else if (strcmp(type_name, "uint16") != 0)
    return fail("unknown type");

  const hid_t file = H5Fcreate(argv[1], H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (file < 0) return fail("cannot create the file");
  if (group) {
    const hid_t g = H5Gcreate2(file, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Gclose(g);
    H5Fclose(file);
    return g < 0 ? fail("cannot create the group") : 0;
  }

  hsize_t extents[2] = {(hsize_t)count, 0};
  if (dims == 2) {
    extents[0] = 2;
    extents[1] = (hsize_t)(count / 2);
  }
  const hid_t space = H5Screate_simple(dims, extents, NULL);
  const hid_t dataset =
      H5Dcreate2(file, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (dataset < 0) return fail("cannot create the dataset");
  if (count > 0) {
    uint32_t* tokens = malloc((size_t)count * sizeof *tokens);
    if (tokens == NULL) return fail("out of memory");
    for (long long i = 0; i < count; ++i) tokens[i] = (uint32_t)((i * 7) % 61 + 1);
    if (bad_position >= 0 && bad_position < count) tokens[bad_position] = (uint32_t)bad_value;
    if (H5Dwrite(dataset, H5T_NATIVE_UINT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens) < 0) {
      return fail("cannot write the tokens");
    }
    free(tokens);
  }

  const hid_t scalar = H5Screate(H5S_SCALAR);
  if (strcmp(vocab, "none") != 0) {
    const int is_float = strcmp(vocab, "float") == 0;
    const hid_t attribute =
        H5Acreate2(dataset, "vocab_size", is_float ? H5T_IEEE_F64LE : H5T_STD_I64LE, scalar,
                   H5P_DEFAULT, H5P_DEFAULT);
    const double as_double = 256.0;
    const int64_t as_integer = atoll(vocab);
    H5Awrite(attribute, is_float ? H5T_NATIVE_DOUBLE : H5T_NATIVE_INT64,
             is_float ? (const void*)&as_double : (const void*)&as_integer);
    H5Aclose(attribute);
  }
  if (strcmp(tokenizer, "int") == 0) {
    const int64_t one = 1;
    const hid_t attribute =
        H5Acreate2(dataset, "tokenizer", H5T_STD_I64LE, scalar, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(attribute, H5T_NATIVE_INT64, &one);
    H5Aclose(attribute);
  } else if (strcmp(tokenizer, "none") != 0) {
    const hid_t text = H5Tcopy(H5T_C_S1);
    H5Tset_size(text, strlen(tokenizer) + 1);
    const hid_t attribute =
        H5Acreate2(dataset, "tokenizer", text, scalar, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(attribute, text, tokenizer);
    H5Aclose(attribute);
    H5Tclose(text);
  }
  H5Sclose(scalar);
  H5Dclose(dataset);
  H5Sclose(space);
  return H5Fclose(file) < 0 ? fail("cannot close the file") : 0;
}
