// The config keys of packed documents and sliding windows (train/config.hpp): data.documents,
// model.rope_document_positions (both absent by default: decided by the data) and
// model.attention_window, read from YAML and --set, dumped and read back, and refused with a
// message naming the key and its value.
#include <gtest/gtest.h>

#include <string>

#include "tests/train/expect_error.hpp"
#include "train/config.hpp"

namespace ringattn::train {
namespace {

using test::throws_error_with;

TEST(ConfigDocuments, DefaultsLeaveTheChoiceToTheData) {
  const TrainConfig c;
  EXPECT_FALSE(c.data.documents.has_value());
  EXPECT_FALSE(c.model.rope_document_positions.has_value());
  EXPECT_EQ(c.model.attention_window, 0);
  const std::string items = config_items(c);
  EXPECT_NE(items.find("data.documents unset"), std::string::npos) << items;
  EXPECT_NE(items.find("model.rope_document_positions unset"), std::string::npos) << items;
  EXPECT_NE(items.find("model.attention_window 0"), std::string::npos) << items;
  // Absent keys are not dumped, so a checkpoint of a run that left them out still leaves them out.
  const std::string yaml = dump_config(c);
  EXPECT_EQ(yaml.find("documents"), std::string::npos) << yaml;
}

TEST(ConfigDocuments, ReadSetDumpedAndReadBack) {
  TrainConfig c = load_config_string(
      "model: {attention_window: 128, rope_document_positions: false}\n"
      "data: {source: hdf5, train_path: t.h5, documents: true}\n",
      "<test>");
  EXPECT_EQ(c.model.attention_window, 128);
  ASSERT_TRUE(c.model.rope_document_positions.has_value());
  EXPECT_FALSE(*c.model.rope_document_positions);
  ASSERT_TRUE(c.data.documents.has_value());
  EXPECT_TRUE(*c.data.documents);
  EXPECT_EQ(load_config_string(dump_config(c), "<dump>"), c);

  apply_override(c, "data.documents=false");
  apply_override(c, "model.rope_document_positions=true");
  apply_override(c, "model.attention_window=0");
  EXPECT_EQ(c.data.documents, std::optional<bool>(false));
  EXPECT_EQ(c.model.rope_document_positions, std::optional<bool>(true));
  EXPECT_EQ(c.model.attention_window, 0);
  EXPECT_EQ(load_config_string(dump_config(c), "<dump>"), c);

  EXPECT_TRUE(throws_error_with([&] { apply_override(c, "data.documents=yes"); },
                                {"data.documents is 'yes'; expected true or false"}));
  EXPECT_TRUE(throws_error_with([&] { apply_override(c, "model.attention_window=wide"); },
                                {"model.attention_window is 'wide'; expected an integer"}));
}

TEST(ConfigDocuments, ValidationNamesTheKeyAndValue) {
  TrainConfig c;
  c.parallel.cp = 1;
  c.model.attention_window = -3;
  EXPECT_TRUE(throws_error_with([&] { validate(c, 1); },
                                {"model.attention_window is -3; expected 0 (no window)"}));
  c.model.attention_window = 0;

  c.data.documents = true;  // data.source retrieval
  EXPECT_TRUE(throws_error_with([&] { validate(c, 1); },
                                {"data.documents is true but data.source is retrieval"}));
  c.data.documents.reset();
  c.model.rope_document_positions = true;
  EXPECT_TRUE(throws_error_with(
      [&] { validate(c, 1); },
      {"model.rope_document_positions is true but data.source is retrieval"}));

  c.data.source = DataSource::hdf5;
  c.data.train_path = "t.h5";
  c.train.eval_every = 0;
  c.data.documents = false;
  EXPECT_TRUE(throws_error_with(
      [&] { validate(c, 1); },
      {"model.rope_document_positions is true but data.documents is false"}));
  c.data.documents = true;
  EXPECT_NO_THROW(validate(c, 1));
  c.model.attention_window = 64;
  EXPECT_NO_THROW(validate(c, 1));
}

}  // namespace
}  // namespace ringattn::train
